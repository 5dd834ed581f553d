// SPDX-License-Identifier: Apache-2.0
// The README's library example, quoted there whole (tests/packaging/docs_test.py checks it is).
#include <turnstile/turnstile.hpp>

#include <chrono>
#include <cstdio>
#include <mutex>

int main(int argc, char** argv) try {
  // A URL (file://, redis://, zk://, etcd://, consul://...), else $TURNSTILE_BACKEND, else file://.
  auto client = argc > 1 ? turnstile::Client::connect(argv[1]) : turnstile::Client::connect();

  auto mutex = client.mutex("jobs/nightly-report");
  {
    std::lock_guard guard(mutex);  // waits its turn (FIFO); unlocks at the end of the scope
    std::printf("one holder at a time; fencing token %llu\n", static_cast<unsigned long long>(mutex.fencing_token()));
  }

  auto pool = client.semaphore("db/connections", 8);  // at most 8 leases at once
  if (auto lease = pool.try_acquire_for(std::chrono::milliseconds(500))) {
    std::puts("got a lease within 0.5 s; it returns when it goes out of scope");
  }
} catch (const turnstile::Error& error) {  // a bad URL, a server that cannot be reached, ...
  std::fprintf(stderr, "%s\n", error.what());
  return error.code() == turnstile::ErrorCode::invalid_url ? 64 : 69;  // EX_USAGE, EX_UNAVAILABLE
}
