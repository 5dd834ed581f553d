// SPDX-License-Identifier: Apache-2.0
// Mutex: one job at a time, across threads and processes.
//
//   ./example_mutex [file:///some/dir]     (default: Client::connect(), i.e. $TURNSTILE_BACKEND
//                                           or the embedded default directory)
//
// Shows std::lock_guard over a turnstile::Mutex, the fencing token that storage can use to
// reject a stale holder, lost_token() with a std::stop_callback to stop work when the hold
// may have been lost, and hold_state() to hold back while a network backend cannot confirm it.
#include <turnstile/turnstile.hpp>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <stop_token>
#include <thread>
#include <vector>

int main(int argc, char** argv) try {
  auto client = argc > 1 ? turnstile::Client::connect(argv[1]) : turnstile::Client::connect();

  // Storage that accepts a write only with a token at least as new as the last one it saw.
  std::atomic<std::uint64_t> last_token{0};
  std::atomic<int> running{0};

  auto job = [&](int worker) {
    auto mutex = client.mutex("jobs/nightly-report");  // cheap handle, by name
    std::lock_guard guard(mutex);                      // blocks until we are first in line

    // If the hold is lost (here: the state directory removed under us), stop the job.
    std::atomic<bool> lost{false};
    std::stop_callback on_loss(mutex.lost_token(), [&] { lost = true; });

    // Suspended: a network backend cannot confirm the hold right now (connection down); work
    // that needs it waits until it is held again (or lost). The embedded backend never suspends.
    while (mutex.hold_state() == turnstile::HoldState::suspended) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }

    const std::uint64_t token = mutex.fencing_token();  // strictly greater than any earlier
    if (token <= last_token.exchange(token)) std::puts("stale holder rejected (never happens)");
    if (running.fetch_add(1) != 0) std::puts("two holders at once (never happens)");
    std::printf("worker %d writes the report with fencing token %llu%s\n", worker,
                static_cast<unsigned long long>(token), lost ? " (hold lost!)" : "");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    running.fetch_sub(1);
  };  // ~lock_guard unlocks: the next worker in line wakes up

  std::vector<std::jthread> workers;
  for (int i = 0; i < 4; ++i) workers.emplace_back(job, i);
  workers.clear();  // join

  // A bounded wait: std::unique_lock with a timeout (try_lock_for underneath).
  auto mutex = client.mutex("jobs/nightly-report");
  if (std::unique_lock lock(mutex, std::chrono::seconds(2)); lock) {
    std::printf("got it within 2 s, token %llu\n", static_cast<unsigned long long>(mutex.fencing_token()));
  }

  // Locking a Mutex twice from one thread throws instead of deadlocking.
  std::lock_guard guard(mutex);
  try {
    mutex.lock();
  } catch (const turnstile::WouldDeadlock& e) {
    std::printf("second lock from the same thread: %s\n", e.what());
  }
  return 0;
} catch (const turnstile::Error& error) {  // a bad URL, a server that cannot be reached, ...
  std::fprintf(stderr, "%s\n", error.what());
  return error.code() == turnstile::ErrorCode::invalid_url ? 64 : 69;  // EX_USAGE, EX_UNAVAILABLE
}
