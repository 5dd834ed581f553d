// SPDX-License-Identifier: Apache-2.0
// Prints Client::metrics().prometheus_text() after a few holds on file://DIR (argv[1]), with the
// name label on and a name that needs escaping, for parse_metrics.py to read with Prometheus'
// own parser (python3-prometheus-client).
#include <cstdio>
#include <iostream>
#include <mutex>

#include <turnstile/turnstile.hpp>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: metrics_text DIR\n";
    return 2;
  }
  turnstile::ClientOptions options;
  options.metrics_name_label = true;
  auto client = turnstile::Client::connect(std::string("file://") + argv[1], options);
  auto mutex = client.mutex("jobs/\"quoted\" \\ name");
  for (int i = 0; i < 3; ++i) std::lock_guard hold(mutex);
  auto semaphore = client.semaphore("pool", 2);
  auto lease = semaphore.acquire(2);
  if (semaphore.try_acquire()) return 1;  // both permits are held: not admitted (timed_out)
  lease.release();
  std::cout << client.metrics().prometheus_text();
  return 0;
}
