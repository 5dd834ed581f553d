// SPDX-License-Identifier: Apache-2.0
// What the processes of a fault run share: the fenced store, the event log each client keeps
// beside its hold history, and the names of a run. See faults_main.cpp for the run itself.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace turnstile::faults {

// The resource the locks protect, as Kleppmann's fencing remedy needs it: one file per name in
// a directory, each remembering the highest token it accepted. A write with a lower token is
// rejected. flock(2) serializes the processes of one host.
class FencedStore {
 public:
  explicit FencedStore(std::string dir);
  struct Outcome {
    bool accepted = false;        // token >= the highest accepted so far for `name`
    std::int64_t ordered_ns = 0;  // monotonic_ns() once the store's lock was taken
  };
  // The write's place in the store's order is the moment its lock is taken: a writer stopped
  // (SIGSTOP) while holding it is ahead of every later writer, which waits for the lock, so a
  // time read after the call returns would put it after holds that began while it was stopped.
  Outcome write(const std::string& name, std::uint64_t token);

 private:
  std::string dir_;
};

// One client's events, one line per event written with one write(2) (O_APPEND):
//   lost    NAME TOKEN START_NS NOTICE_NS   a hold the client was told it lost
//   timeout NAME REQUEST_NS GAVE_UP_NS      an acquire that timed out
//   write   NAME TOKEN AT_NS ACCEPTED       a write to the fenced store (ACCEPTED 0 or 1), AT_NS
//                                           the moment the store ordered it (Outcome)
//   error   NAME AT_NS TEXT                 an acquire or release that failed
class EventLog {
 public:
  explicit EventLog(const std::string& path);
  ~EventLog();
  EventLog(const EventLog&) = delete;
  EventLog& operator=(const EventLog&) = delete;
  void line(const std::string& text);

 private:
  int fd_ = -1;
};

struct Event {
  std::string type;  // lost, timeout, write, error
  std::string name;
  std::uint64_t token = 0;
  std::int64_t a_ns = 0;  // lost: start; timeout: request; write: at; error: at
  std::int64_t b_ns = 0;  // lost: notice; timeout: gave up
  bool accepted = false;  // write
};

// Every event of every *.events file in `dir`.
std::vector<Event> load_events(const std::string& dir);

// The names a run uses under `prefix`: mutexes, semaphores (limit kSemaphoreLimit) and
// reader/writer locks, `per_kind` of each.
inline constexpr std::int64_t kSemaphoreLimit = 2;
std::vector<std::string> run_names(const std::string& prefix, int per_kind);
bool is_semaphore_name(const std::string& name);
// An election's name (leaderships are recorded as exclusive holds: one leader at a time).
bool is_election_name(const std::string& name);

}  // namespace turnstile::faults
