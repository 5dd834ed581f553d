// SPDX-License-Identifier: Apache-2.0
// Semaphore: at most N concurrent calls to a fragile dependency, across threads and processes.
//
//   ./example_semaphore [file:///some/dir]
//
// Each call holds a Lease (RAII): it is returned when the Lease goes out of scope, and also
// when the holding process dies, kill -9 included, so a crash never leaks capacity.
#include <turnstile/turnstile.hpp>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <thread>
#include <vector>

namespace {

std::atomic<int> in_flight{0};
std::atomic<int> most_in_flight{0};

// Stands for the dependency that falls over with more than 2 concurrent callers.
void call_fragile_service(int caller) {
  const int now = ++in_flight;
  int seen = most_in_flight.load();
  while (now > seen && !most_in_flight.compare_exchange_weak(seen, now)) {
  }
  std::printf("caller %d calling (%d in flight)\n", caller, now);
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  --in_flight;
}

}  // namespace

int main(int argc, char** argv) try {
  auto client = argc > 1 ? turnstile::Client::connect(argv[1]) : turnstile::Client::connect();
  constexpr std::int64_t kLimit = 2;  // every contender must use the same limit

  std::vector<std::jthread> callers;
  for (int i = 0; i < 6; ++i) {
    callers.emplace_back([&, i] {
      auto service = client.semaphore("services/fragile", kLimit);
      turnstile::Lease lease = service.acquire();  // waits, in arrival order
      call_fragile_service(i);
    });  // ~Lease: released, the next caller in line is admitted
  }
  callers.clear();  // join
  std::printf("at most %d call(s) were in flight at once (limit %lld)\n", most_in_flight.load(),
              static_cast<long long>(kLimit));

  // A bounded wait that gives up: both leases held, so a third cannot be had within 50 ms.
  auto service = client.semaphore("services/fragile", kLimit);
  turnstile::Lease both = service.acquire(2);
  if (auto extra = service.try_acquire_for(std::chrono::milliseconds(50)); !extra) {
    std::puts("third lease refused after 50 ms: the service is saturated");
  }
  both.release();  // explicit release reports errors as exceptions
  return most_in_flight.load() <= kLimit ? 0 : 1;
} catch (const turnstile::Error& error) {  // a bad URL, a server that cannot be reached, ...
  std::fprintf(stderr, "%s\n", error.what());
  return error.code() == turnstile::ErrorCode::invalid_url ? 64 : 69;  // EX_USAGE, EX_UNAVAILABLE
}
