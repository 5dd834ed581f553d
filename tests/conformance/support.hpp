// SPDX-License-Identifier: Apache-2.0
// Shared scaffolding of the conformance suite: the backend parameter, the fixture, child
// processes, pipes and bounded waits. The suite uses only the public API of turnstile.
#pragma once

#include <gtest/gtest.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <turnstile/turnstile.hpp>

#include "conformance/backend_param.hpp"
#include "testing/hold_history.hpp"

namespace conformance {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
namespace th = turnstile::testing;

std::string param_label(const ::testing::TestParamInfo<BackendParam>& info);

class Conformance : public ::testing::TestWithParam<BackendParam> {
 public:
  // Polls until `predicate` holds or `timeout` passes; returns the predicate's last value.
  static bool eventually(const std::function<bool()>& predicate, std::chrono::milliseconds timeout = 10s);

 protected:
  void SetUp() override;
  void TearDown() override;

  const std::string& url() const { return url_; }
  // True on the network backends (a server with leases), false on the embedded file:// one.
  bool has_server() const { return url_.rfind("file:", 0) != 0; }
  // Made on first use, so a test that forks its children first forks a process with no
  // backend threads yet (gRPC in particular is fragile across fork).
  turnstile::Client& client();
  // A new, independent client on the same backend.
  turnstile::Client connect(turnstile::ClientOptions options = {}) const;
  // A name unique to this test (and run), so tests never see each other's state.
  std::string name(std::string_view leaf) const { return prefix_ + "/" + std::string(leaf); }
  // A path in this test's scratch directory (history files and the like).
  std::string scratch_path(std::string_view leaf) const { return scratch_ + "/" + std::string(leaf); }

  // Until inspect(name) shows exactly `count` waiters (bounded).
  bool wait_for_waiters(const std::string& name, std::size_t count, std::chrono::milliseconds timeout = 10s);
  std::size_t waiter_count(const std::string& name);
  std::size_t holder_count(const std::string& name);

  // Fails the test when the history breaks a promise; `limit` is the lease limit, 0 for locks.
  static void expect_sound(const std::vector<th::HoldRecord>& history, std::int64_t limit = 0);

 private:
  std::string scratch_;
  std::string url_;
  std::string prefix_;
  std::mutex client_mutex_;
  std::optional<turnstile::Client> client_;
};

// A forked child process. The body runs in the child and its return value is the exit status;
// an exception in it prints its message and exits 99. The child must build its own Client.
//
// Fork while the test process has no other threads where you can: a thread holding an
// allocator lock at fork time (the sanitizers' allocators have no fork handlers) leaves that
// lock held forever in the child. spawn_gated() forks now, while the parent is still
// single-threaded, and runs the body only when start() is called (it exits 96 if never started).
class Child {
 public:
  static Child spawn(std::function<int()> body);
  static Child spawn_gated(std::function<int()> body);
  Child(Child&& other) noexcept : pid_(other.pid_), go_fd_(other.go_fd_) {
    other.pid_ = -1;
    other.go_fd_ = -1;
  }
  Child& operator=(Child&&) = delete;
  ~Child();  // kills and reaps a child still running

  // Lets a gated child run its body.
  void start();

  pid_t pid() const { return pid_; }
  // The exit status, 128+signal when killed, or -1 when it did not end in time (it is then
  // killed).
  int wait(std::chrono::milliseconds timeout = 15s);
  bool running();
  void kill(int signal);

 private:
  Child(pid_t pid, int go_fd) : pid_(pid), go_fd_(go_fd) {}
  static Child fork_with(std::function<int()> body, bool gated);
  pid_t pid_;
  int go_fd_ = -1;
};

// One-way byte channel between processes (or threads): created before fork.
class Pipe {
 public:
  Pipe();
  ~Pipe();
  Pipe(const Pipe&) = delete;
  Pipe& operator=(const Pipe&) = delete;

  void send(char byte = '!');
  // The next byte, or nullopt when none came in time or the writers are gone.
  std::optional<char> receive(std::chrono::milliseconds timeout = 10s);
  void close_write();

 private:
  int read_fd_ = -1;
  int write_fd_ = -1;
};

// Runs body(i) on `count` threads and joins them.
void run_threads(int count, const std::function<void(int)>& body);

// Elapsed milliseconds since `start`.
inline long long elapsed_ms(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
}

// Sleeps in the child until killed (bounded, so a broken test never leaves a process behind).
[[noreturn]] void linger_in_child(std::chrono::seconds at_most = 30s);

// A holder's record: construct it BEFORE asking for the hold (the request time), call held()
// right after it was granted, finish() right before releasing. The recorded interval then lies
// inside the real hold, as the history checker requires.
struct Stopwatch {
  std::int64_t requested = th::monotonic_ns();
  std::int64_t start = 0;
  void held() { start = th::monotonic_ns(); }
  th::HoldRecord finish(std::string name, std::string kind, std::int64_t permits, std::uint64_t token) const {
    th::HoldRecord record{std::move(name), std::move(kind), permits, token, start, th::monotonic_ns()};
    record.request_ns = requested;
    return record;
  }
};

// Calls `fn` on scope exit (releases held locks when an assertion bails out early, so
// background threads blocked on them can finish).
class OnExit {
 public:
  explicit OnExit(std::function<void()> fn) : fn_(std::move(fn)) {}
  ~OnExit() {
    if (fn_) fn_();
  }
  void dismiss() { fn_ = nullptr; }
  OnExit(const OnExit&) = delete;
  OnExit& operator=(const OnExit&) = delete;

 private:
  std::function<void()> fn_;
};

}  // namespace conformance
