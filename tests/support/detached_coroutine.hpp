// SPDX-License-Identifier: Apache-2.0
// The least coroutine type there is, for tests that co_await an acquire: it runs at once when
// called, and its frame is freed when its body ends (no suspension at the start or the end).
#pragma once

#include <coroutine>
#include <exception>

namespace turnstile::testing {

struct Detached {
  struct promise_type {
    Detached get_return_object() { return {}; }
    std::suspend_never initial_suspend() { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() {}
    void unhandled_exception() { std::terminate(); }
  };
};

}  // namespace turnstile::testing
