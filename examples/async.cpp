// SPDX-License-Identifier: Apache-2.0
// Async acquires: waiting for a lock without parking a thread.
//
//   ./example_async [file:///some/dir]     (default: Client::connect())
//
// lock_async() and acquire_async() return an Acquiring: co_await it from any C++20 coroutine
// (here a minimal coroutine type of our own, no framework), or give it a callback with then().
// While it waits in line it costs no thread: the client's small pool (ClientOptions::async_threads)
// runs the acquire's steps and resumes the coroutine or calls the callback. The hold belongs to
// the Lease it gives, not to a thread: a coroutine resumed on another thread still owns it.
#include <turnstile/async.hpp>
#include <turnstile/turnstile.hpp>

#include <atomic>
#include <chrono>
#include <coroutine>
#include <cstdio>
#include <exception>
#include <latch>
#include <optional>

namespace {

// The smallest coroutine type that will do: it starts at once, runs to its end (resuming where
// each co_await left it) and frees its frame itself. Whoever starts one learns that it ended
// through the latch it is given.
struct Job {
  struct promise_type {
    Job get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }  // each job below catches its own
  };
};

std::atomic<int> holding{0};

Job write_report(turnstile::Client& client, int worker, std::latch& finished) {
  try {
    auto mutex = client.mutex("jobs/nightly-report");
    // Suspends until first in line; no thread waits meanwhile. nullopt: not acquired (deadline,
    // stop or cancel; none here).
    std::optional<turnstile::Lease> hold = co_await mutex.lock_async();
    if (holding.fetch_add(1) != 0) std::puts("two holders at once (never happens)");
    std::printf("coroutine %d holds the report lock, fencing token %llu\n", worker,
                static_cast<unsigned long long>(hold->fencing_token()));
    holding.fetch_sub(1);
  } catch (const turnstile::Error& error) {  // the backend could not be reached, ...
    std::printf("coroutine %d: %s\n", worker, error.what());
  }
  finished.count_down();
}  // the Lease ends here: the next coroutine in line is resumed

}  // namespace

int main(int argc, char** argv) try {
  auto client = argc > 1 ? turnstile::Client::connect(argv[1]) : turnstile::Client::connect();

  // 1. Coroutines: four jobs queue for one Mutex and run one at a time, in queue order (the order
  //    their joins reach the queue, which the client's pool threads may make in any order).
  std::latch coroutines_finished(4);
  for (int worker = 0; worker < 4; ++worker) write_report(client, worker, coroutines_finished);
  coroutines_finished.wait();

  // 2. A callback: three acquires on a Semaphore of 2. The callback runs on a client pool thread
  //    when the acquire ends (keep it short: the pool drives every acquire of the client).
  auto pool = client.semaphore("db/connections", 2);
  std::latch callbacks_finished(3);
  for (int caller = 0; caller < 3; ++caller) {
    pool.acquire_async(1).then([&, caller](auto acquiring) {
      try {
        std::optional<turnstile::Lease> lease = acquiring.get();  // ended: does not block
        std::printf("callback %d got %s\n", caller, lease ? "a lease" : "nothing");
      } catch (const turnstile::Error& error) {
        std::printf("callback %d: %s\n", caller, error.what());
      }
      callbacks_finished.count_down();
    });  // the lease ends with the callback
  }
  callbacks_finished.wait();

  // 3. Giving up: while the name is held, an acquire with a deadline ends with nullopt, having
  //    left the queue (a std::stop_token in AsyncOptions, or cancel(), end it the same way).
  auto report = client.mutex("jobs/nightly-report");
  std::optional<turnstile::Lease> held = report.lock_async().get();  // get() waits like a future
  turnstile::AsyncOptions soon;
  soon.deadline = turnstile::SteadyClock::now() + std::chrono::milliseconds(100);
  auto other = client.mutex("jobs/nightly-report").lock_async(soon);
  std::printf("while held, a 100 ms acquire got %s\n", other.get() ? "the lock (never happens)" : "nothing");
  return 0;
} catch (const turnstile::Error& error) {  // a bad URL, a server that cannot be reached, ...
  std::fprintf(stderr, "%s\n", error.what());
  return error.code() == turnstile::ErrorCode::invalid_url ? 64 : 69;  // EX_USAGE, EX_UNAVAILABLE
}
