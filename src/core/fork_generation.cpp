// SPDX-License-Identifier: Apache-2.0
#include "core/fork_generation.hpp"

#include <pthread.h>

#include <atomic>

namespace turnstile::detail {
namespace {

std::atomic<std::uint64_t> generation{0};

// Registered when the library loads, before any hold can exist.
const int registered = pthread_atfork(nullptr, nullptr, [] { generation.fetch_add(1, std::memory_order_relaxed); });

}  // namespace

std::uint64_t fork_generation() noexcept {
  (void)registered;
  return generation.load(std::memory_order_relaxed);
}

}  // namespace turnstile::detail
