// SPDX-License-Identifier: Apache-2.0
// What the embedded backend takes from the C library, wrapped once: the one place where its
// errors become turnstile exceptions, owned descriptors that a forked child never uses, OFD
// locks on bytes, the futex doorbell, and small facts about this process and host.
#pragma once

#include <sys/types.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "turnstile/deadline.hpp"

namespace turnstile::detail::file_state {

// AccessDenied for EACCES/EPERM, BackendUnavailable otherwise, with `what` and strerror.
[[noreturn]] void fail_io(const std::string& what, int error = errno);

// ---- fork ----------------------------------------------------------------------------------
// The core's fork generation (core/fork_generation.hpp): objects remember the one they were
// made in, and an object from an earlier one belongs to the parent.
std::uint64_t current_generation();

// An object whose mutexes the fork handlers take, so that a forked child finds them unlocked
// and what they guard whole.
class ForkLocked {
 public:
  virtual void lock_for_fork() = 0;
  virtual void unlock_after_fork() = 0;

 protected:
  ~ForkLocked() = default;
};
void register_for_fork(ForkLocked* object);
void unregister_for_fork(ForkLocked* object);

// An open descriptor of this backend, closed when destroyed unless it belongs to a parent
// process (a forked child closed those at the fork; the number may be reused since).
class Fd {
 public:
  Fd() = default;
  // Takes a descriptor just opened, or -1 (leaving errno alone).
  explicit Fd(int fd);
  ~Fd() { reset(); }
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)), generation_(other.generation_) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
      generation_ = other.generation_;
    }
    return *this;
  }
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  void reset() noexcept;

 private:
  int fd_ = -1;
  std::uint64_t generation_ = 0;
};

// ---- locks on bytes ------------------------------------------------------------------------
// F_OFD_SETLK(W): false when `wait` is false and someone else holds a conflicting lock.
bool set_lock(int fd, short type, off_t start, off_t length, bool wait);
// Whether someone holds a byte of [start, start + length) (length 0: to infinity), tested from a
// descriptor that never holds locks itself.
bool is_locked(int probe_fd, off_t start, off_t length);

// The PermitCounter doorbell: a futex word in a shared mapping (cross-process, so no
// FUTEX_PRIVATE_FLAG). A truncated mapping makes these fail with EFAULT; the caller then finds
// the file broken under the mutex.
void futex_wait(std::uint32_t* word, std::uint32_t seen, Deadline deadline);
void futex_wake_all(std::uint32_t* word);

// ---- storage of a sparse file ------------------------------------------------------------
// Backs the pages of [offset, offset + length) of a file with storage before anything is written
// there. The file is sparse: a page is otherwise allocated when first touched, and on a full
// file system (a 5 MB /run/lock) that touch is a SIGBUS, possibly with a mutex held. Asked only
// when a write reaches a page not written before; refused with a clear error (naming `name`).
void back_with_storage(int fd, std::size_t offset, std::size_t length, const std::string& name);
// Gives the storage of the whole pages inside [offset, offset + length) back to the file system
// (the file keeps its size; they read as zeros, and are backed again before the next write).
// Best effort: a file system that cannot punch holes keeps them.
void give_back_storage(int fd, std::size_t offset, std::size_t length) noexcept;

// ---- this process and host -----------------------------------------------------------------
pid_t my_pid();  // cached; forgotten in a forked child
std::int64_t realtime_ns();
std::int64_t boottime_ns();  // CLOCK_BOOTTIME: one clock for every process of this boot
const std::string& boot_id();
std::uint64_t fnv1a(const std::string& text);

}  // namespace turnstile::detail::file_state
