// SPDX-License-Identifier: Apache-2.0
// Waiting for a lock byte of a state file to be released, with a deadline, a stop token or
// without a thread of one's own (an armed wake-up). F_OFD_SETLKW has no timeout, so a thread
// blocks in it for us (one per byte, shared by the process's listeners of that byte) and tells
// the listeners when it gets the byte; a listener that gives up first stops listening, and the
// last one to go cancels the thread.
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

// Told when a byte it listens to is released: a thread asleep in wait_for_any_release, or an
// armed wake-up (local_entries.hpp). Must not block.
class ReleaseListener {
 public:
  virtual ~ReleaseListener() = default;
  virtual void released() = 0;
};

class ByteWatches {
 public:
  // `open_description` gives a fresh open file description of the state file for each thread.
  explicit ByteWatches(std::function<Fd()> open_description) : open_description_(std::move(open_description)) {}

  // Sleeps until one of the bytes is released (by leaving or by its owner's death), the
  // deadline passes or a stop is requested.
  void wait_for_any_release(const std::vector<off_t>& offsets, Deadline deadline, const std::stop_token& stop);

  // A listener's watches; destroying it stops listening (and ends the threads nobody else
  // listens to).
  class Listening {
   public:
    Listening() = default;
    Listening(Listening&& other) noexcept;
    Listening& operator=(Listening&& other) noexcept;
    ~Listening();

   private:
    friend class ByteWatches;
    ByteWatches* owner_ = nullptr;
    std::shared_ptr<ReleaseListener> listener_;
    std::vector<std::shared_ptr<ByteWatch>> watches_;
  };
  // Tells `listener` once one of the bytes is released, from a watcher thread: never from this
  // call, even when a byte is free already (a new watcher then finds it so at once).
  Listening listen(const std::vector<off_t>& offsets, std::shared_ptr<ReleaseListener> listener);

 private:
  std::shared_ptr<ByteWatch> listen_to_byte(off_t offset, const std::shared_ptr<ReleaseListener>& listener);
  void stop_listening(Listening& listening) noexcept;

  std::function<Fd()> open_description_;
  std::mutex mutex_;
  std::unordered_map<off_t, std::shared_ptr<ByteWatch>> watches_;  // the bytes listened to
};

}  // namespace turnstile::detail::file_state
