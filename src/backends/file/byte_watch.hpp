// Waiting with a deadline or a stop token for a lock byte of a state file to be released.
// F_OFD_SETLKW has no timeout, so a thread blocks in it for us (one per byte, shared by the
// process's waiters of that byte) and wakes the waiters when it gets the byte; a waiter that
// gives up first stops listening, and the last one to go cancels the thread.
#pragma once

#include <sys/types.h>

#include <functional>
#include <memory>
#include <mutex>
#include <stop_token>
#include <unordered_map>
#include <vector>

#include "backends/file/os.hpp"
#include "turnstile/deadline.hpp"

namespace turnstile::detail::file_state {

struct ByteWatch;

class ByteWatches {
 public:
  // `open_description` gives a fresh open file description of the state file for each thread.
  explicit ByteWatches(std::function<Fd()> open_description) : open_description_(std::move(open_description)) {}

  // Sleeps until one of the bytes is released (by leaving or by its owner's death), the
  // deadline passes or a stop is requested.
  void wait_for_any_release(const std::vector<off_t>& offsets, Deadline deadline, const std::stop_token& stop);

 private:
  std::shared_ptr<ByteWatch> watch_byte(off_t offset);

  std::function<Fd()> open_description_;
  std::mutex mutex_;
  std::unordered_map<off_t, std::shared_ptr<ByteWatch>> watches_;  // the bytes listened to
};

}  // namespace turnstile::detail::file_state
