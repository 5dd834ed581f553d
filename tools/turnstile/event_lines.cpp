// SPDX-License-Identifier: Apache-2.0
// The CLI's event hook (event_lines.hpp).
#include "event_lines.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "common.hpp"

namespace turnstile::cli {
namespace {

// --events' descriptor, closed when the last copy of the hook goes ("-": stderr, not closed).
struct EventsFile {
  int fd = -1;
  bool owned = false;
  ~EventsFile() {
    if (owned) close(fd);
  }
};

std::shared_ptr<EventsFile> open_events_file(const std::string& path) {
  auto file = std::make_shared<EventsFile>();
  if (path == "-") {
    file->fd = STDERR_FILENO;
    return file;
  }
  const auto cannot = [&path](const std::string& why) {
    return EventsFileError("cannot open --events file '" + printable(path) + "': " + why);
  };
  // O_NONBLOCK: opening a FIFO nobody reads fails at once (ENXIO) instead of waiting for good
  // for a reader, before anything is held.
  file->fd = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NONBLOCK, 0666);
  if (file->fd < 0) {
    const int error = errno;
    struct stat status {};
    const bool fifo = stat(path.c_str(), &status) == 0 && S_ISFIFO(status.st_mode);
    throw cannot(error == ENXIO && fifo ? "no process reads the FIFO" : std::strerror(error));
  }
  file->owned = true;
  // Written blocking again, as a file opened plainly (json_lines_sink gives up on a line that
  // waits a second).
  const int flags = fcntl(file->fd, F_GETFL);
  if (flags < 0 || fcntl(file->fd, F_SETFL, flags & ~O_NONBLOCK) != 0) throw cannot(std::strerror(errno));
  return file;
}

std::string milliseconds_text(std::chrono::nanoseconds duration) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", static_cast<double>(duration.count()) / 1e6);
  return text;
}

// -v already says when a hold was taken, suspended, confirmed again, lost and released (see
// take_hold.cpp, hold.cpp, run.cpp): from the hook it adds what only the client sees.
bool said_by_verbose(EventKind kind) {
  return kind == EventKind::connected || kind == EventKind::reconnected || kind == EventKind::renewal_failed;
}

}  // namespace

std::string describe_event(const Event& event) {
  const std::string where = event.backend.empty() ? "the backend" : event.backend;
  const std::string hold = "'" + event.name + "' (fencing token " + std::to_string(event.fencing_token) + ")";
  switch (event.kind) {
    case EventKind::acquired: return "acquired " + hold + " after " + milliseconds_text(event.duration) + " ms";
    case EventKind::not_acquired:
      return "did not acquire '" + event.name + "' (" + event.outcome + ") after " + milliseconds_text(event.duration) +
             " ms";
    case EventKind::released: return "released " + hold + " after " + milliseconds_text(event.duration) + " ms";
    case EventKind::suspended: return "the hold on " + hold + " is suspended (" + event.reason + ")";
    case EventKind::resumed: return "the hold on " + hold + " is confirmed again";
    case EventKind::lost: return "the hold on " + hold + " may have been lost (" + event.reason + ")";
    case EventKind::renewed: return "renewed on " + where + " in " + milliseconds_text(event.duration) + " ms";
    case EventKind::renewal_failed: return "a renewal on " + where + " failed: " + event.reason;
    case EventKind::connected: return "connected to " + where;
    case EventKind::reconnected: return "reconnected to " + where;
  }
  return "event on " + where;
}

EventHandler event_handler_for(const RunOptions& options) {
  if (!options.events && !options.verbose) return {};
  EventHandler lines;
  if (options.events) {
    auto file = open_events_file(*options.events);
    lines = [file, sink = json_lines_sink(file->fd)](const Event& event) { sink(event); };
  }
  return [lines, verbose = options.verbose](const Event& event) {
    if (lines) lines(event);
    if (verbose && said_by_verbose(event.kind)) complain(describe_event(event));
  };
}

}  // namespace turnstile::cli
