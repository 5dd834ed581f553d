// SPDX-License-Identifier: Apache-2.0
// fork(): a child process inherits its parent's memory, holds included, but not its place on the
// server or in the kernel. The core counts forks so that a child never treats an inherited hold
// as its own: it neither uses it (a reentrant lock() would otherwise count up without asking the
// backend) nor releases it (which would free the parent's hold under it).
#pragma once

#include <cstdint>

namespace turnstile::detail {

// Grows by one in every child of fork(); a hold made under another generation is inherited.
std::uint64_t fork_generation() noexcept;

}  // namespace turnstile::detail
