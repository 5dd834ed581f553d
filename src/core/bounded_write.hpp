// SPDX-License-Identifier: Apache-2.0
// A write that never waits for good: for lines a process tells while it should be stopping or
// releasing (the CLI's messages on stderr, --events' JSON lines), where a reader that takes
// nothing (a pipe nobody reads, a stopped terminal) must cost a lost line, not a hang.
#pragma once

#include <chrono>
#include <cstddef>
#include <string_view>

namespace turnstile::detail {

// Writes all of `bytes` to `fd`, unless that takes longer than `patience` (then what is left is
// dropped) or the descriptor fails. Never waits in write() itself. How many bytes were written: fewer than all, but
// some, leaves a torn line the caller must end before its next one.
std::size_t write_within(int fd, std::string_view bytes, std::chrono::milliseconds patience) noexcept;

}  // namespace turnstile::detail
