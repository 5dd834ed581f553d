// SPDX-License-Identifier: Apache-2.0
// Many lock_async() on one name, each with a completion callback that records its admission:
// what the async wake-up and async-waiter tests queue (issue 26).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <vector>

#include <turnstile/turnstile.hpp>

namespace wakeups {

// Raises this process's descriptor limit to its hard limit: a crowd on file:// may keep a
// descriptor per entry it watches.
void raise_descriptor_limit();

class AsyncCrowd {
 public:
  // Room for `capacity` acquires, allocated now (so that memory measured after it is theirs).
  explicit AsyncCrowd(std::size_t capacity);
  // Stops the acquires still waiting, waits (bounded) for every callback, then ends the holds:
  // the waiters leave before an admitted hold lets the next one in.
  ~AsyncCrowd();
  AsyncCrowd(const AsyncCrowd&) = delete;
  AsyncCrowd& operator=(const AsyncCrowd&) = delete;

  // Starts one more lock_async() through `mutex` (kept here); returns its index.
  std::size_t add(turnstile::Mutex mutex, turnstile::Deadline deadline = std::nullopt);
  // Admissions so far (acquires that ended with a hold).
  std::size_t admitted();
  // The index of the k-th admission (0-based), once it has come; nullopt after `timeout`.
  std::optional<std::size_t> wait_for_admission(std::size_t k, std::chrono::milliseconds timeout);
  // Hands over acquire i's hold (it ends when the caller drops it).
  std::optional<turnstile::Lease> take(std::size_t i);
  // What ended an acquire with an error, one line each.
  std::vector<std::string> errors();

 private:
  void ended(std::size_t index, turnstile::Acquiring<std::optional<turnstile::Lease>> done);

  std::stop_source give_up_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<turnstile::Mutex> mutexes_;  // stable addresses: an acquire may refer to its Mutex
  std::vector<std::optional<turnstile::Lease>> leases_;
  std::vector<std::size_t> admissions_;  // indexes, in the order the callbacks ran
  std::vector<std::string> errors_;
  std::size_t started_ = 0;
  std::size_t ended_ = 0;
};

}  // namespace wakeups
