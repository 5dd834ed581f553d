// SPDX-License-Identifier: Apache-2.0
// Waking a waiter without a thread of its own (QueuePlace::arm, CounterLine::arm). The bytes an
// armed waiter waits on belong to entries of this client (most of a process's waiters wait on
// the entry just ahead, which is most often its own) or of other processes. Our own entries
// tell their armed waiters themselves when they drop a byte (leave, release, downgrade, a lease
// admitted); only bytes of other processes need a watcher thread (byte_watch.hpp), and those
// threads are shared per byte. Why that is as safe as blocking on the byte: docs/backends/file.md.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "backends/file/byte_watch.hpp"
#include "backends/file/state.hpp"
#include "core/queue_store.hpp"

namespace turnstile::detail::file_state {

class StateFile;

// The bit of `which` in a mask of an entry's bytes.
constexpr unsigned byte_bit(Byte which) { return 1u << static_cast<unsigned>(which); }
constexpr unsigned kAllBytes = byte_bit(Byte::life) | byte_bit(Byte::exclusive) | byte_bit(Byte::waiting);

// One armed wake-up: runs `wake` at most once, unless disarmed first.
class ArmedWake final : public ReleaseListener {
 public:
  explicit ArmedWake(Wake wake) : wake_(std::move(wake)) {}
  void released() override;
  // Once it returns, the wake neither runs nor will (a running one is waited for).
  void disarm() noexcept;

 private:
  std::mutex mutex_;
  std::condition_variable done_;
  Wake wake_;  // empty once run or disarmed
  bool running_ = false;
};

// One client's own entries in one state file, the bytes each still holds, and the wake-ups
// armed on them. The entries are kept under the state file's guard, which every join, leave
// and arm takes anyway: no lock or system call of its own on the uncontended path.
class LocalEntries {
 public:
  // Under the guard: our entry `seq` holds the bytes of `bytes` now (appended under it).
  void added(std::uint64_t seq, unsigned bytes);
  // Under the guard: our entry `seq` drops the bytes of `bytes`, or did (its slot changed under
  // the guard first). The wake-ups armed on them run as the guard ends (take_woken).
  void dropped(std::uint64_t seq, unsigned bytes);
  // Under the guard: whether our entry `seq` holds byte `which` (locked before it was added here,
  // dropped here before it is unlocked: true means the kernel has it locked). False once
  // abandoned, or when not found (the caller asks the kernel).
  bool holds(std::uint64_t seq, Byte which) const;
  // Under the guard: listens to byte `which` of our entry `seq` if that still holds it; false
  // when it does not (not ours, or dropped already: the caller watches the byte itself).
  bool listen(std::uint64_t seq, Byte which, const std::shared_ptr<ReleaseListener>& listener);
  void stop_listening(const ReleaseListener* listener) noexcept;
  // A leave that could not take the guard: our record is no longer trusted (later arms watch
  // every byte through the kernel) and everyone listening is told now.
  void abandon() noexcept;
  // Under the guard: the wake-ups that dropped bytes took, to run once it is let go.
  bool has_woken() const { return !woken_.empty(); }
  std::vector<std::shared_ptr<ReleaseListener>> take_woken() { return std::exchange(woken_, {}); }

 private:
  struct Entry {
    std::uint64_t seq;
    unsigned bytes;
  };
  struct Listener {
    std::uint64_t seq;
    unsigned bit;
    std::shared_ptr<ReleaseListener> listener;
  };
  std::vector<Entry> entries_;                           // under the guard
  std::vector<std::shared_ptr<ReleaseListener>> woken_;  // under the guard
  std::mutex mutex_;                                     // listeners_ (an arm's end takes no guard)
  std::vector<Listener> listeners_;
  std::atomic<std::size_t> listening_{0};  // listeners_.size(), read without the mutex
  std::atomic<bool> abandoned_{false};
};

// Tells each listener (a guard's end, after it let go of the mutex).
void tell_released(const std::vector<std::shared_ptr<ReleaseListener>>& listeners) noexcept;

// A wake-up for the release of byte `which` of any of the entries `seqs`: told by our own
// entries, watched by a shared thread for the others'. Never runs inside this call.
std::unique_ptr<WakeArm> arm_for_release(const std::shared_ptr<StateFile>& file, const std::vector<std::uint64_t>& seqs,
                                         Byte which, Wake wake);

}  // namespace turnstile::detail::file_state
