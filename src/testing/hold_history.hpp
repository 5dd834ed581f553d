// SPDX-License-Identifier: Apache-2.0
// Hold-history checker: holders record when they held what, and check() finds every moment
// the history breaks a promise of turnstile (mutual exclusion, reader/writer exclusion, a
// Semaphore's limit, fencing tokens that grow). Plain C++20: it does not depend on the
// turnstile library, so the tests, the parking demo and future interop tests can share it.
//
// Recording protocol: take start_ns right AFTER the acquisition returned and end_ns right
// BEFORE the release is called, both with monotonic_ns() (CLOCK_MONOTONIC, comparable between
// the processes of one host). Every recorded interval then lies inside the real hold, so two
// recorded intervals that overlap prove that two real holds overlapped.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace turnstile::testing {

struct HoldRecord {
  std::string name;
  std::string kind;  // "exclusive", "shared" or "lease"
  std::int64_t permits = 1;
  std::uint64_t token = 0;
  std::int64_t start_ns = 0;
  std::int64_t end_ns = 0;
  // When the holder asked for the hold (taken before calling acquire/lock), or 0 if unknown.
  // Only the shared/lease fencing rule uses it (see check()).
  std::int64_t request_ns = 0;
};

// CLOCK_MONOTONIC in nanoseconds.
std::int64_t monotonic_ns();

// Thread-safe, in memory: for holders that are threads of one process.
class HoldRecorder {
 public:
  void record(HoldRecord record);
  std::vector<HoldRecord> records() const;
  std::size_t size() const;
  void clear();

 private:
  mutable std::mutex mutex_;
  std::vector<HoldRecord> records_;
};

// Cross-process: appends one line per hold to a file opened with O_APPEND, each line in a
// single write(2), so lines of concurrent processes never interleave. Safe to use from several
// threads, and from a child after fork() (the child may also make its own recorder).
class FileHoldRecorder {
 public:
  // Opens (creating, mode 0600) the file for appending. Throws std::system_error.
  explicit FileHoldRecorder(std::string path);
  ~FileHoldRecorder();
  FileHoldRecorder(const FileHoldRecorder&) = delete;
  FileHoldRecorder& operator=(const FileHoldRecorder&) = delete;

  // Throws std::system_error when the line cannot be written whole.
  void record(const HoldRecord& record);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

// One line of the file format (with its '\n') and back. parse_line throws
// std::invalid_argument on a malformed line.
std::string format_line(const HoldRecord& record);
HoldRecord parse_line(std::string_view line);

// Every record of a file written by FileHoldRecorder; a missing file is an empty history.
// Throws std::invalid_argument naming the line number of a malformed line.
std::vector<HoldRecord> load_history(const std::string& path);

// The Semaphore limit of a name; a value <= 0 means "unknown: do not check leases against it".
using LimitForName = std::function<std::int64_t(const std::string& name)>;

// Human-readable violations, empty when the history is sound. Per name:
//  * malformed records (end before start, unknown kind, permits <= 0);
//  * two overlapping exclusive holds; an exclusive hold (writer) overlapping any other hold;
//  * more than limit_for_name(name) lease permits held at one moment;
//  * fencing: exclusive holds must carry unique tokens that strictly increase in order of
//    start time; a hold that starts after another hold of the name ended must carry a greater
//    token when either of the two is exclusive; and a shared or lease hold whose request_ns is
//    after another hold's end must carry a greater token than it.
//    (Why request_ns for shared/lease: a reader admitted by the queue may return from lock()
//    late, after a reader admitted just behind it already came and went; its recorded start is
//    then after the other's end although it was admitted first. Only the time it asked proves
//    it joined the queue after the other left. With an exclusive hold involved no such overlap
//    of real holds is possible, so the recorded start suffices.)
// A shared record carrying the same token as an exclusive record that started before it and
// was still held when it started is that writer's downgrade (one queue entry), not a conflict.
// Overlap is strict: a hold ending at the very nanosecond another starts does not overlap it.
std::vector<std::string> check(const std::vector<HoldRecord>& records, const LimitForName& limit_for_name = {});
// The same limit for every name.
std::vector<std::string> check(const std::vector<HoldRecord>& records, std::int64_t limit);

// The peak of overlapping permits (a lease counts its permits, a lock hold 1) over all the
// records given, whatever their names; the second form only counts records of `name`.
std::int64_t max_concurrency(const std::vector<HoldRecord>& records);
std::int64_t max_concurrency(const std::vector<HoldRecord>& records, const std::string& name);

// The violations joined one per line, for test failure messages.
std::string describe(const std::vector<std::string>& violations);

}  // namespace turnstile::testing
