// SPDX-License-Identifier: Apache-2.0
// PermitCounter: Redisson RSemaphore semantics. A shared number of permits that anyone may take
// and anyone may return. Nothing is owned: a process that dies keeps what it took, so use
// turnstile::Semaphore when that matters.
//
//   ./example_permit_counter [file:///some/dir]
#include <turnstile/turnstile.hpp>

#include <cstdio>
#include <thread>

int main(int argc, char** argv) try {
  auto client = argc > 1 ? turnstile::Client::connect(argv[1]) : turnstile::Client::connect();
  auto budget = client.permit_counter("crawler/budget");

  // Initialise once: the first process to get here sets it, later ones find it set.
  if (budget.try_set_permits(10)) std::puts("budget initialised to 10");
  else std::printf("budget already set: %lld left\n", static_cast<long long>(budget.available_permits()));
  budget.drain_permits();  // start this demo from a known state...
  budget.add_permits(10);  // ...of 10 permits

  budget.acquire(4);  // take 4 (waits, in arrival order, if fewer are available)
  std::printf("took 4, %lld left\n", static_cast<long long>(budget.available_permits()));

  // A waiter for 8 sleeps until enough permits come back, from any thread or process.
  std::jthread big([&] {
    auto same = client.permit_counter("crawler/budget");
    same.acquire(8);
    std::puts("the big request got its 8 permits");
    same.release(8);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  budget.release(4);  // anyone may release: no ownership check
  big.join();

  budget.add_permits(-3);  // shrink the budget; the count may even go negative
  std::printf("after add_permits(-3): %lld\n", static_cast<long long>(budget.available_permits()));
  std::printf("try_acquire(8): %s\n", budget.try_acquire(8) ? "yes (bug!)" : "no, only 7 left");

  // The Lockable view takes n permits in lock() and returns them in unlock().
  {
    auto two = budget.lockable(2);
    std::lock_guard guard(two);
    std::printf("holding 2 via lockable, %lld left\n", static_cast<long long>(budget.available_permits()));
  }

  const auto drained = budget.drain_permits();  // takes everything, returns how much it was
  std::printf("drained %lld, now %lld\n", static_cast<long long>(drained),
              static_cast<long long>(budget.available_permits()));
  return 0;
} catch (const turnstile::Error& error) {  // a bad URL, a server that cannot be reached, ...
  std::fprintf(stderr, "%s\n", error.what());
  return error.code() == turnstile::ErrorCode::invalid_url ? 64 : 69;  // EX_USAGE, EX_UNAVAILABLE
}
