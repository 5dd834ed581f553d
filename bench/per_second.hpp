// SPDX-License-Identifier: Apache-2.0
// How many times per second `body` runs in a loop of `seconds`, after 200 warm-up runs: the
// uncontended benchmarks' measure (etcd_uncontended.cpp, consul_uncontended.cpp).
#pragma once

#include <chrono>

template <class Body>
double per_second(double seconds, Body body) {
  using Clock = std::chrono::steady_clock;
  for (int i = 0; i < 200; ++i) body();
  const auto start = Clock::now();
  long count = 0;
  while (std::chrono::duration<double>(Clock::now() - start).count() < seconds) {
    body();
    ++count;
  }
  return count / std::chrono::duration<double>(Clock::now() - start).count();
}
