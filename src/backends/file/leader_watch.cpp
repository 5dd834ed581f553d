// SPDX-License-Identifier: Apache-2.0
// What wakes a LeaderObserver on file:// (Backend::watch_leader), without a thread of its own.
// The leader changes when its entry leaves (its value file is removed), when a candidate joins
// an empty election or proclaims (a value file is renamed into place: values.hpp), or when the
// leader dies (its life byte is freed). The directory's inotify events, watched from the
// observer's creation on (before its first read), catch the first kinds; an armed wake-up on
// the leader's life byte (local_entries.hpp: our own entries tell it, a shared thread per byte
// watches other processes') catches a death, and a dead leader found as the wait begins is
// removed at once (so a death between the observer's read and its wait is not missed either).
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <functional>
#include <thread>

#include "backends/file/file_backend.hpp"
#include "backends/file/local_entries.hpp"

namespace turnstile::detail {

using namespace file_state;

namespace {

// The directory events that may change a name's leader: value files renamed in (join, proclaim)
// or removed (leave, a dead entry swept), and the state file itself made, replaced or removed.
constexpr std::uint32_t kLeaderEvents = IN_MOVED_TO | IN_MOVED_FROM | IN_CREATE | IN_DELETE | IN_ONLYDIR;

class FileLeaderWatch final : public LeaderWatch {
 public:
  // `open_file` gives the name's state file, or nullptr when it has none.
  using OpenFile = std::function<std::shared_ptr<StateFile>()>;
  FileLeaderWatch(const std::string& root, const std::string& name, OpenFile open_file)
      : base_(StateFile::base_of(name)), open_file_(std::move(open_file)),
        inotify_(inotify_init1(IN_NONBLOCK | IN_CLOEXEC)), wakeup_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
    // Without events (the user's inotify instances are used up: fs.inotify.max_user_instances)
    // the observer looks again every Backend::kLeaderPoll instead.
    if (inotify_ && inotify_add_watch(inotify_.get(), root.c_str(), kLeaderEvents) < 0) inotify_.reset();
  }

  void wait(Deadline deadline, const std::stop_token& stop) override {
    if (!inotify_ || !wakeup_) deadline = earlier(deadline, SteadyClock::now() + Backend::kLeaderPoll);
    if (inotify_ && events_about_us()) return;
    bool head_kept = false;
    {
      std::unique_ptr<WakeArm> arm;
      if (auto file = open_file_()) {
        std::uint64_t head = 0;
        if (removed_dead_head(*file, head, head_kept)) return;
        if (head != 0 && !head_kept) arm = arm_for_release(file, {head}, Byte::life, [this] { ring(); });
      }
      // A kept leader (release_after) has no life byte: looked at again after one poll period.
      if (head_kept) deadline = earlier(deadline, SteadyClock::now() + Backend::kLeaderPoll);
      std::stop_callback on_stop(stop, [this] { ring(); });
      sleep(deadline, stop);
    }  // disarmed: nothing rings after this
    std::uint64_t rung = 0;
    while (wakeup_ && read(wakeup_.get(), &rung, sizeof rung) > 0) {
    }
  }

 private:
  static Deadline earlier(Deadline deadline, SteadyClock::time_point other) {
    return deadline && *deadline < other ? deadline : Deadline(other);
  }

  void ring() noexcept {
    const std::uint64_t one = 1;
    if (wakeup_) static_cast<void>(write(wakeup_.get(), &one, sizeof one));
  }

  // Sleeps until an event about our files, a ring (the leader's byte, a stop) or the deadline.
  void sleep(Deadline deadline, const std::stop_token& stop) {
    for (;;) {
      if (stop.stop_requested()) return;
      int timeout = -1;
      if (deadline) {
        const auto left = std::chrono::ceil<std::chrono::milliseconds>(*deadline - SteadyClock::now()).count();
        if (left <= 0) return;
        timeout = static_cast<int>(std::min<std::int64_t>(left, INT_MAX));
      }
      pollfd fds[2] = {{.fd = wakeup_.get(), .events = POLLIN, .revents = 0},
                       {.fd = inotify_.get(), .events = POLLIN, .revents = 0}};
      const int ready = poll(fds, inotify_ ? 2 : 1, timeout);
      if (ready < 0 && errno != EINTR) return;  // looked at again by the observer's read
      if (ready > 0 && (fds[0].revents != 0 || events_about_us())) return;
    }
  }

  // Reads the queued events (without waiting); true when one may concern this name (or some
  // were dropped: the queue overflowed).
  bool events_about_us() {
    alignas(inotify_event) char buffer[8192];
    bool ours = false;
    for (;;) {
      const auto n = read(inotify_.get(), buffer, sizeof buffer);
      if (n <= 0) return ours;
      for (ssize_t at = 0; at < n;) {
        const auto* event = reinterpret_cast<const inotify_event*>(buffer + at);
        at += static_cast<ssize_t>(sizeof(inotify_event) + event->len);
        if (event->mask & IN_Q_OVERFLOW) ours = true;
        if (event->len == 0) continue;
        const std::string_view file_name(event->name, strnlen(event->name, event->len));
        ours |= file_name == base_ + ".s" ||
                (file_name.starts_with(base_) && file_name.substr(base_.size()).starts_with(".v."));
      }
    }
  }

  // Under the guard: true when the first candidate was dead (removed now: the leader changed),
  // else `head` is the live first candidate's seq (0: none) and `kept` says it has no life byte.
  static bool removed_dead_head(StateFile& file, std::uint64_t& head, bool& kept) {
    StateFile::Guard guard(file);
    for (std::size_t i = 0; i < file.count() && !file.broken(); ++i) {
      const auto& slot = file.slot(i);
      if (slot.kind == kCounterWaiter) continue;
      if (!file.alive(slot)) return file.remove_if_dead(slot.seq);
      head = slot.seq;
      kept = StateFile::kept(slot);
      return false;
    }
    return false;
  }

  std::string base_;
  OpenFile open_file_;
  Fd inotify_;
  Fd wakeup_;
};

}  // namespace

std::unique_ptr<LeaderWatch> FileBackend::watch_leader(const std::string& name) {
  return std::make_unique<FileLeaderWatch>(
      root_, name, [this, name]() -> std::shared_ptr<StateFile> { return has_state(name) ? file(name) : nullptr; });
}

}  // namespace turnstile::detail
