// SPDX-License-Identifier: Apache-2.0
#include "backends/file/os.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstring>
#include <fstream>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "core/fork_generation.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail::file_state {

void fail_io(const std::string& what, int error) {
  if (error == EACCES || error == EPERM) throw AccessDenied(what + ": " + std::strerror(error));
  throw BackendUnavailable(what + ": " + std::strerror(error));
}

// ---- fork ----------------------------------------------------------------------------------
namespace {

// getpid() is a real system call (glibc no longer caches it) and every join records the pid
// (for inspect): cached, and forgotten in a forked child, which must record its own.
std::atomic<pid_t> cached_pid{0};

// Every descriptor this backend opened, so a forked child can close them all, and every object
// whose mutexes the fork handlers take.
struct ForkRegistry {
  std::mutex objects_mutex;  // before any object's mutexes, before fds_mutex
  std::vector<ForkLocked*> objects;
  std::mutex fds_mutex;
  std::unordered_set<int> fds;
};

ForkRegistry& registry();

void before_fork() {
  auto& r = registry();
  r.objects_mutex.lock();
  for (auto* object : r.objects) object->lock_for_fork();
  r.fds_mutex.lock();
}

void unlock_objects(ForkRegistry& r) {
  for (auto it = r.objects.rbegin(); it != r.objects.rend(); ++it) (*it)->unlock_after_fork();
  r.objects_mutex.unlock();
}

void in_parent() {
  auto& r = registry();
  r.fds_mutex.unlock();
  unlock_objects(r);
}

void in_child() {
  auto& r = registry();
  // The parent's descriptions stay the parent's: a child that shared one could convert or drop
  // the parent's locks with its own, and one that kept them would keep the parent's holds alive
  // after the parent died.
  for (int fd : r.fds) close(fd);
  r.fds.clear();
  cached_pid.store(0, std::memory_order_relaxed);
  r.fds_mutex.unlock();
  unlock_objects(r);
}

ForkRegistry& registry() {
  static ForkRegistry* const instance = [] {
    auto* r = new ForkRegistry;  // never destroyed: fork handlers and exit-time destructors use it
    pthread_atfork(before_fork, in_parent, in_child);
    return r;
  }();
  return *instance;
}

}  // namespace

std::uint64_t current_generation() { return fork_generation(); }

void register_for_fork(ForkLocked* object) {
  auto& r = registry();
  std::lock_guard lock(r.objects_mutex);
  r.objects.push_back(object);
}

void unregister_for_fork(ForkLocked* object) {
  auto& r = registry();
  std::lock_guard lock(r.objects_mutex);
  std::erase(r.objects, object);
}

Fd::Fd(int fd) : fd_(fd), generation_(current_generation()) {
  if (fd_ < 0) return;
  auto& r = registry();
  std::lock_guard lock(r.fds_mutex);
  r.fds.insert(fd_);
}

void Fd::reset() noexcept {
  if (fd_ < 0) return;
  if (generation_ == current_generation()) {
    auto& r = registry();
    std::lock_guard lock(r.fds_mutex);  // not untracked-then-closed apart: a fork between the two
    r.fds.erase(fd_);                   // would leave the child a description we close here
    close(fd_);
  }
  fd_ = -1;
}

// ---- locks on bytes ------------------------------------------------------------------------

bool set_lock(int fd, short type, off_t start, off_t length, bool wait) {
  struct flock fl {};
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = start;
  fl.l_len = length;
  while (fcntl(fd, wait ? F_OFD_SETLKW : F_OFD_SETLK, &fl) != 0) {
    if (errno == EINTR) continue;
    if (!wait && (errno == EAGAIN || errno == EACCES)) return false;
    fail_io("file lock");
  }
  return true;
}

bool is_locked(int probe_fd, off_t start, off_t length) {
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = start;
  fl.l_len = length;
  if (fcntl(probe_fd, F_OFD_GETLK, &fl) != 0) fail_io("file lock test");
  return fl.l_type != F_UNLCK;
}

void futex_wait(std::uint32_t* word, std::uint32_t seen, Deadline deadline) {
  timespec at{};
  if (deadline) {
    // steady_clock is CLOCK_MONOTONIC, FUTEX_WAIT_BITSET's clock for an absolute timeout.
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline->time_since_epoch()).count();
    at.tv_sec = static_cast<time_t>(std::max<long long>(ns, 0) / 1'000'000'000);
    at.tv_nsec = static_cast<long>(std::max<long long>(ns, 0) % 1'000'000'000);
  }
  syscall(SYS_futex, word, FUTEX_WAIT_BITSET, seen, deadline ? &at : nullptr, nullptr, FUTEX_BITSET_MATCH_ANY);
}

void futex_wake_all(std::uint32_t* word) { syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }

// ---- storage of a sparse file ------------------------------------------------------------
namespace {
constexpr std::size_t kStoragePage = 4096;
}

void back_with_storage(int fd, std::size_t offset, std::size_t length, const std::string& name) {
  const auto first = offset / kStoragePage * kStoragePage;
  const auto last = (offset + length + kStoragePage - 1) / kStoragePage * kStoragePage;
  int error;
  do {
    error = fallocate(fd, 0, static_cast<off_t>(first), static_cast<off_t>(last - first)) == 0 ? 0 : errno;
  } while (error == EINTR);
  if (error == EOPNOTSUPP) return;  // a file system without it: pages are allocated as touched
  if (error != 0) fail_io("no room for the state of '" + name + "'", error);
}

void give_back_storage(int fd, std::size_t offset, std::size_t length) noexcept {
  const auto first = (offset + kStoragePage - 1) / kStoragePage * kStoragePage;
  const auto last = (offset + length) / kStoragePage * kStoragePage;
  if (last <= first) return;
  fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(first),
            static_cast<off_t>(last - first));
}

// ---- this process and host -----------------------------------------------------------------

pid_t my_pid() {
  pid_t pid = cached_pid.load(std::memory_order_relaxed);
  if (pid == 0) {
    pid = getpid();
    cached_pid.store(pid, std::memory_order_relaxed);
  }
  return pid;
}

std::int64_t realtime_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return std::int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

std::int64_t boottime_ns() {
  timespec ts{};
  clock_gettime(CLOCK_BOOTTIME, &ts);
  return std::int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

const std::string& boot_id() {
  static const std::string id = [] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string text;
    std::getline(in, text);
    return text;
  }();
  return id;
}

std::uint64_t fnv1a(const std::string& text) {
  std::uint64_t hash = 1469598103934665603ULL;
  for (unsigned char c : text) hash = (hash ^ c) * 1099511628211ULL;
  return hash;
}

}  // namespace turnstile::detail::file_state
