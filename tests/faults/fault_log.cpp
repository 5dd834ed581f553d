// SPDX-License-Identifier: Apache-2.0
#include "fault_log.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

#include "testing/hold_history.hpp"

namespace turnstile::faults {

namespace {

std::string file_name_for(const std::string& name) {
  std::string out;
  for (const char c : name) out += (c == '/') ? '_' : c;
  return out;
}

// Closes a descriptor on every path out.
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

FencedStore::FencedStore(std::string dir) : dir_(std::move(dir)) { std::filesystem::create_directories(dir_); }

FencedStore::Outcome FencedStore::write(const std::string& name, std::uint64_t token) {
  const auto path = dir_ + "/" + file_name_for(name);
  Fd file{::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600)};
  if (file.fd < 0) throw std::system_error(errno, std::generic_category(), "open " + path);
  while (::flock(file.fd, LOCK_EX) != 0) {
    if (errno != EINTR) throw std::system_error(errno, std::generic_category(), "flock " + path);
  }
  const std::int64_t ordered_ns = testing::monotonic_ns();
  std::uint64_t highest = 0;
  const auto got = ::pread(file.fd, &highest, sizeof highest, 0);
  if (got != 0 && got != static_cast<ssize_t>(sizeof highest)) {
    throw std::system_error(EIO, std::generic_category(), "read " + path);
  }
  if (token < highest) return {false, ordered_ns};
  if (::pwrite(file.fd, &token, sizeof token, 0) != static_cast<ssize_t>(sizeof token)) {
    throw std::system_error(errno, std::generic_category(), "write " + path);
  }
  return {true, ordered_ns};  // the lock goes with the descriptor
}

EventLog::EventLog(const std::string& path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (fd_ < 0) throw std::system_error(errno, std::generic_category(), "open " + path);
}

EventLog::~EventLog() { ::close(fd_); }

void EventLog::line(const std::string& text) {
  const auto whole = text + "\n";
  while (::write(fd_, whole.data(), whole.size()) < 0 && errno == EINTR) {
  }
}

std::vector<Event> load_events(const std::string& dir) {
  std::vector<Event> events;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".events") continue;
    std::ifstream in(entry.path());
    std::string text;
    while (std::getline(in, text)) {
      std::istringstream fields(text);
      Event event;
      fields >> event.type >> event.name;
      if (event.type == "lost") {
        fields >> event.token >> event.a_ns >> event.b_ns;
      } else if (event.type == "timeout") {
        fields >> event.a_ns >> event.b_ns;
      } else if (event.type == "write") {
        int accepted = 0;
        fields >> event.token >> event.a_ns >> accepted;
        event.accepted = accepted != 0;
      } else if (event.type == "error") {
        fields >> event.a_ns;
      } else {
        continue;  // a line cut short by kill -9 of its writer cannot happen (one write), but skip any
      }
      if (fields.fail()) continue;
      events.push_back(std::move(event));
    }
  }
  return events;
}

std::vector<std::string> run_names(const std::string& prefix, int per_kind) {
  std::vector<std::string> names;
  for (int i = 0; i < per_kind; ++i) {
    names.push_back(prefix + "/mutex" + std::to_string(i));
    names.push_back(prefix + "/sem" + std::to_string(i));
    names.push_back(prefix + "/rw" + std::to_string(i));
    names.push_back(prefix + "/elect" + std::to_string(i));
  }
  return names;
}

bool is_semaphore_name(const std::string& name) { return name.find("/sem") != std::string::npos; }
bool is_election_name(const std::string& name) { return name.find("/elect") != std::string::npos; }

}  // namespace turnstile::faults
