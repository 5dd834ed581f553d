// The embedded backend: processes and threads of one host, no server.
//
// Each name has a small state file under the root directory, mapped into every process that
// uses it (layout in state.hpp). Its header holds a process-shared robust mutex, the fencing
// counter and the queue (an array of entries in arrival order). Liveness never comes from
// clocks or process ids: every entry owns open-file-description (OFD) locks on bytes of the
// state file far beyond its end, at an offset derived from its unique sequence number, and the
// kernel drops them when the process dies. A waiter blocks on exactly the bytes whose release
// can change its verdict:
//   life byte       held while the entry exists       (mutex and writer waits; the head lease
//                                                      waiter watches those of every holder ahead)
//   exclusive byte  held while the entry is a writer  (reader waits; dropped on downgrade)
//   waiting byte    held while a lease waits          (the next lease in line waits on it)
// PermitCounter's head waiter sleeps on a futex word of the mapping that adders bump. Nothing
// polls on a timer.
//
// fork(): a child never uses or releases what its parent opened. The atfork child handler
// closes every descriptor this backend opened (so a child neither keeps its parent's holds
// alive nor shares an open file description with it), and the objects made before the fork
// see a new fork generation: their holds throw HoldLost instead of touching the queue, and a
// Client used in the child opens everything afresh.
#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <set>
#include <stop_token>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "backends/file/state.hpp"
#include "core/backend.hpp"

namespace turnstile::detail {
namespace {

using namespace file_state;

// A client keeps at most this many names open while nothing of theirs is held or waited for,
// and at most this many spare descriptions per name: what it keeps is bounded, whatever the
// number of names it ever used — idle names cost at most 16 · (1 + 2) descriptors; a held
// name costs 2 (its file, the hold's description), a waiting one 3 (a watcher's, while it waits).
constexpr std::size_t kIdleNames = 16;
constexpr std::size_t kSpareDescriptors = 2;

[[noreturn]] void fail_io(const std::string& what, int error = errno) {
  if (error == EACCES || error == EPERM) throw AccessDenied(what + ": " + std::strerror(error));
  throw BackendUnavailable(what + ": " + std::strerror(error));
}

class FileBackend;

// ---- fork ----------------------------------------------------------------------------------

// Bumped in every forked child: objects remember the generation they were made in, and an
// object from an earlier one belongs to the parent.
std::atomic<std::uint32_t> fork_generation{0};

std::uint32_t current_generation() { return fork_generation.load(std::memory_order_relaxed); }

// Every descriptor this backend opened, so a forked child can close them all, and every live
// backend, whose mutexes the fork handlers take so the child finds them consistent.
struct ForkRegistry {
  std::mutex backends_mutex;  // before any backend's mutexes, before fds_mutex
  std::vector<FileBackend*> backends;
  std::mutex fds_mutex;
  std::unordered_set<int> fds;
};

ForkRegistry& registry();

int tracked(int fd) {
  if (fd >= 0) {
    auto& r = registry();
    std::lock_guard lock(r.fds_mutex);
    r.fds.insert(fd);
  }
  return fd;
}

// Closes a descriptor opened in this process's generation (a parent's, already closed by the
// child handler, is left alone: its number may belong to something else by now).
void close_tracked(int fd, std::uint32_t generation) {
  if (fd < 0 || generation != current_generation()) return;
  auto& r = registry();
  std::lock_guard lock(r.fds_mutex);  // not untracked-then-closed apart: a fork between the two
  r.fds.erase(fd);                    // would leave the child a description we close here
  close(fd);
}

// ---- SIGBUS-safe access to the mapping -------------------------------------------------------

// A state file truncated under us (by hand, a cleaner) turns every access to its mapping into
// SIGBUS. While a thread accesses a mapping it names it here; a SIGBUS inside it replaces the
// mapping with zeroed private memory (so the access completes, harmlessly) and marks the file
// broken, which the caller reports: holds lost, calls failing. Other SIGBUSes go to the handler
// that was installed before ours.
struct MappedRange {
  char* base;
  std::size_t size;
  std::atomic<bool>* broken;
  MappedRange* previous;
};

__attribute__((tls_model("initial-exec"))) thread_local MappedRange* current_range = nullptr;
struct sigaction previous_sigbus {};

void on_sigbus(int signal, siginfo_t* info, void* context) {
  for (auto* range = current_range; range; range = range->previous) {
    auto* address = static_cast<char*>(info->si_addr);
    if (info->si_code > 0 && address >= range->base && address < range->base + range->size) {
      if (mmap(range->base, range->size, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) !=
          MAP_FAILED) {
        range->broken->store(true, std::memory_order_relaxed);
        return;  // the faulting access runs again, on the zeroed memory
      }
      break;
    }
  }
  if (previous_sigbus.sa_flags & SA_SIGINFO) {
    if (previous_sigbus.sa_sigaction) previous_sigbus.sa_sigaction(signal, info, context);
    return;
  }
  if (previous_sigbus.sa_handler == SIG_DFL || previous_sigbus.sa_handler == SIG_IGN) {
    // Die as we would have without us: a fault recurs when we return, a sent signal is re-raised.
    struct sigaction fallback {};
    fallback.sa_handler = SIG_DFL;
    sigaction(SIGBUS, &fallback, nullptr);
    if (info->si_code <= 0) raise(SIGBUS);
    return;
  }
  previous_sigbus.sa_handler(signal);
}

void install_sigbus_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action {};
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    sigaction(SIGBUS, &action, &previous_sigbus);
  });
}

class MappingAccess {
 public:
  MappingAccess(void* base, std::size_t size, std::atomic<bool>& broken)
      : range_{static_cast<char*>(base), size, &broken, current_range} {
    current_range = &range_;
    std::atomic_signal_fence(std::memory_order_seq_cst);
  }
  ~MappingAccess() {
    std::atomic_signal_fence(std::memory_order_seq_cst);
    current_range = range_.previous;
  }
  MappingAccess(const MappingAccess&) = delete;
  MappingAccess& operator=(const MappingAccess&) = delete;

 private:
  MappedRange range_;
};

// ---- small helpers -------------------------------------------------------------------------

// getpid() is a real system call (glibc no longer caches it) and every join records the pid
// (for inspect): cache it, and forget it in a forked child, which must record its own.
std::atomic<pid_t> cached_pid{0};

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

// The fencing token (and sequence number) of a new entry: max(last + 1, CLOCK_REALTIME in µs),
// as on Redis. Strictly increasing while the state file lives, and still above every earlier
// token of the name when the file was removed, truncated or replaced (a cleaner, rm -rf), as
// long as the clock was not stepped back by more than the time since the last token.
// (2^40 + 4·token stays below the largest lock offset, 2^63 - 1, for some 70,000 years.)
std::uint64_t next_token(const Header& h) {
  const auto now_us = static_cast<std::uint64_t>(std::max<std::int64_t>(realtime_ns() / 1000, 0));
  return std::max(h.next_seq + 1, now_us);
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

const std::string& host_name() {
  static const std::string host = [] {
    char buffer[256] = {};
    gethostname(buffer, sizeof buffer - 1);
    return std::string(buffer);
  }();
  return host;
}

// File names: ASCII letters, digits and "-_." kept, every other byte (including '/' and every
// byte >= 0x80) percent-encoded, so no name can traverse or collide. A pure function of the
// bytes: never std::isalnum, which follows the C locale (a Latin-1 locale would keep 0xE9).
// Long names fall back to a hash checked against the stored name.
bool kept_as_is(unsigned char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
         c == '.';
}

std::uint64_t fnv1a(const std::string& text) {
  std::uint64_t hash = 1469598103934665603ULL;
  for (unsigned char c : text) hash = (hash ^ c) * 1099511628211ULL;
  return hash;
}

std::string encode_name(const std::string& name) {
  static constexpr char hex[] = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : name) {
    if (kept_as_is(c)) {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  if (out.size() <= 200) return "n." + out;
  const std::uint64_t hash = fnv1a(name);
  std::string prefix = "h.";
  for (int shift = 60; shift >= 0; shift -= 4) prefix += hex[(hash >> shift) & 15];
  return prefix + "." + out.substr(0, 180);
}

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

// Whether someone holds a byte of [start, start + length) (length 0: to infinity): tested from
// a descriptor that never holds locks itself.
bool is_locked(int probe_fd, off_t start, off_t length) {
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = start;
  fl.l_len = length;
  if (fcntl(probe_fd, F_OFD_GETLK, &fl) != 0) fail_io("file lock test");
  return fl.l_type != F_UNLCK;
}

bool is_locked(int probe_fd, std::uint64_t seq, Byte which) { return is_locked(probe_fd, byte_offset(seq, which), 1); }

// The PermitCounter doorbell: a futex word in the shared mapping (cross-process, so no
// FUTEX_PRIVATE_FLAG). A truncated mapping makes these fail with EFAULT; the caller then finds
// the file broken under the mutex.
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

// Wakes one waiting thread: byte watchers, a stop request.
class Waker {
 public:
  void wake() {
    {
      std::lock_guard lock(mutex_);
      woken_ = true;
    }
    cv_.notify_all();
  }
  void sleep(Deadline deadline) {
    std::unique_lock lock(mutex_);
    if (deadline) {
      cv_.wait_until(lock, *deadline, [&] { return woken_; });
    } else {
      cv_.wait(lock, [&] { return woken_; });
    }
    woken_ = false;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool woken_ = false;
};

// A thread blocked in F_OFD_SETLKW on one byte, on a description of its own, shared by the
// process's waiters for that byte. It ends when the byte is released (by leaving, or by its
// owner's death), waking everyone listening, or when its last listener stops listening (a
// deadline, a stop, another byte's release): it is then cancelled, which ends its blocked
// fcntl (a cancellation point, and the only point where it accepts cancellation) and closes its
// description. So a wait that ends leaves no thread or descriptor behind, however long the
// byte stays held.
struct ByteWatch {
  std::mutex mutex;
  bool released = false;
  bool finished = false;  // set by the thread as its last act: `thread` may be gone after it
  std::vector<std::shared_ptr<Waker>> listeners;
  pthread_t thread{};
  int fd = -1;
  off_t offset = 0;
  std::uint32_t generation = 0;

  void listen(const std::shared_ptr<Waker>& waker) {
    {
      std::lock_guard lock(mutex);
      listeners.push_back(waker);
      if (!released) return;
    }
    waker->wake();
  }
  // Returns whether anyone still listens.
  bool unlisten(const std::shared_ptr<Waker>& waker) {
    std::lock_guard lock(mutex);
    std::erase(listeners, waker);
    return !listeners.empty();
  }
  // Ends the thread if it still waits (the caller made sure nobody listens or will).
  void cancel() {
    std::lock_guard lock(mutex);
    if (!finished) pthread_cancel(thread);  // the thread cannot exit while we hold the mutex
  }
  void finish() {
    std::vector<std::shared_ptr<Waker>> told;
    {
      std::lock_guard lock(mutex);
      released = true;
      finished = true;
      told = listeners;
    }
    for (auto& listener : told) listener->wake();
  }
};

void finish_byte_watch(void* argument) {
  std::unique_ptr<std::shared_ptr<ByteWatch>> owner(static_cast<std::shared_ptr<ByteWatch>*>(argument));
  ByteWatch& watch = **owner;
  close_tracked(watch.fd, watch.generation);  // drops the read lock too, if we got it
  watch.finish();
}

// A failed wait is reported as a release too: the waiter looks at the queue again and decides.
void* run_byte_watch(void* argument) {
  int ignored;
  pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &ignored);
  auto& watch = **static_cast<std::shared_ptr<ByteWatch>*>(argument);
  struct flock fl {};
  fl.l_type = F_RDLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = watch.offset;
  fl.l_len = 1;
  pthread_cleanup_push(finish_byte_watch, argument);
  pthread_setcancelstate(PTHREAD_CANCEL_ENABLE, &ignored);
  while (fcntl(watch.fd, F_OFD_SETLKW, &fl) != 0 && errno == EINTR) {
  }
  pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &ignored);
  pthread_cleanup_pop(1);
  return nullptr;
}

// ---- pins on the directory -----------------------------------------------------------------

// Read locks on bytes of the backend directory itself, which outlives every state file in it:
// one byte per name (a hash of it), held by a process for as long as it holds anything of that
// name. A state file that is missing is created afresh only while nobody pins its name, so a
// held state file removed or moved away (rm, a tmp cleaner) lets nobody else in while its
// holder lives, whether or not it has noticed yet. All holds of a client in one directory share
// one description of it and count per byte; probes use the directory's main descriptor, which
// never holds OFD locks, so they see this process's pins too.
class DirectoryPins {
 public:
  explicit DirectoryPins(int root_fd) : root_fd_(root_fd) {}
  ~DirectoryPins() { close_tracked(fd_, generation_); }
  DirectoryPins(const DirectoryPins&) = delete;
  DirectoryPins& operator=(const DirectoryPins&) = delete;

  static off_t byte_of(const std::string& name) { return static_cast<off_t>(fnv1a(name) & ((std::uint64_t{1} << 62) - 1)); }

  void pin(off_t byte) {
    std::lock_guard lock(mutex_);
    if (fd_ < 0) {
      fd_ = tracked(openat(root_fd_, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
      if (fd_ < 0) fail_io("cannot open the backend directory");
    }
    auto& count = counts_[byte];
    if (count == 0) set_lock(fd_, F_RDLCK, byte, 1, false);  // read locks never conflict: no wait
    ++count;
  }
  void unpin(off_t byte) {
    if (generation_ != current_generation()) return;  // a parent's pin: closed at the fork
    std::lock_guard lock(mutex_);
    auto it = counts_.find(byte);
    if (it == counts_.end()) return;
    if (--it->second == 0) {
      counts_.erase(it);
      set_lock(fd_, F_UNLCK, byte, 1, false);
    }
  }
  bool pinned(off_t byte) const { return is_locked(root_fd_, byte, 1); }

 private:
  int root_fd_;
  int fd_ = -1;
  std::uint32_t generation_ = current_generation();
  std::mutex mutex_;
  std::unordered_map<off_t, std::size_t> counts_;
};

// ---- one name's state file -----------------------------------------------------------------

class NameFile {
 public:
  NameFile(int root_fd, std::shared_ptr<DirectoryPins> pins, std::string name);
  ~NameFile();
  NameFile(const NameFile&) = delete;
  NameFile& operator=(const NameFile&) = delete;

  // Holds the robust mutex; repairs the state when its last owner died inside. Accesses to the
  // mapping under it survive a truncation (see MappingAccess): check broken() before trusting
  // what was read, and check_intact() before handing out a result.
  class Guard {
   public:
    explicit Guard(NameFile& file);
    ~Guard() { pthread_mutex_unlock(&file_.header_->mutex); }
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;

   private:
    NameFile& file_;
    MappingAccess access_;
  };

  Header& header() { return *header_; }
  const std::string& name() const { return name_; }
  int probe_fd() const { return fd_; }
  std::uint32_t generation() const { return generation_; }
  // A fresh open file description for one contender: OFD locks of one description never
  // conflict with each other, so contenders in one process must not share one.
  int checkout_descriptor();
  // Returns a description that holds no locks (kept as a spare, or closed).
  void return_descriptor(int fd);
  // Sleeps until one of the bytes is released (by leaving or by death), the deadline passes or
  // a stop is requested.
  void wait_for_any_release(const std::vector<off_t>& offsets, Deadline deadline, const std::stop_token& stop);
  // Under the guard: wakes PermitCounter waiters after permits appeared.
  void ring_counter();

  // Under the guard:
  std::ptrdiff_t find(std::uint64_t seq) const;
  void append(const Entry& entry);
  void remove_at(std::size_t index);
  bool remove_if_dead(std::uint64_t seq);
  void sweep_dead();
  void recompute_mode();
  // The state was truncated or overwritten under us: nothing read from it can be trusted.
  bool broken() const { return broken_.load(std::memory_order_relaxed); }
  void check_intact() const;
  // Whether the state file is still the one at its path, whole: a removed, replaced or
  // truncated file means the holds it records no longer exclude anyone.
  bool still_valid();
  // Pins the name on the directory (see DirectoryPins) for one hold, and says whether this file
  // is still the one at its path. Pinned first, checked after: a file found in place was in
  // place when the pin was taken, so whoever creates a new one later sees the pin. Unpins and
  // returns false otherwise.
  bool pin_if_current();
  void unpin() { pins_->unpin(pin_byte_); }

 private:
  void open_or_create(int root_fd);
  void create(int root_fd);
  void replace(int root_fd, ino_t ino, std::uint64_t carried_seq);
  void repair();
  std::shared_ptr<ByteWatch> watch_byte(off_t offset);

  std::string name_;
  std::string base_;
  std::string state_name_ = base_ + ".s";
  int root_fd_ = -1;
  std::shared_ptr<DirectoryPins> pins_;
  off_t pin_byte_ = DirectoryPins::byte_of(name_);
  int fd_ = -1;
  Header* header_ = nullptr;
  std::atomic<bool> broken_{false};
  std::uint32_t generation_ = current_generation();
  std::mutex pool_mutex_;
  std::vector<int> pool_;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  std::mutex watches_mutex_;
  std::unordered_map<off_t, std::shared_ptr<ByteWatch>> watches_;  // the bytes listened to
};

NameFile::Guard::Guard(NameFile& file) : file_(file), access_(file.header_, sizeof(Header), file.broken_) {
  int rc = pthread_mutex_lock(&file_.header_->mutex);
  if (rc == EOWNERDEAD) {
    file_.repair();
    pthread_mutex_consistent(&file_.header_->mutex);
  } else if (rc != 0) {
    fail_io("state mutex of '" + file_.name_ + "'", rc);
  }
  if (file_.header_->magic != kMagic) file_.broken_.store(true, std::memory_order_relaxed);  // zeroed
}

void NameFile::check_intact() const {
  if (broken()) {
    throw BackendUnavailable("the state file of '" + name_ + "' was truncated or overwritten while in use");
  }
}

NameFile::NameFile(int root_fd, std::shared_ptr<DirectoryPins> pins, std::string name)
    : name_(std::move(name)), base_(encode_name(name_)), root_fd_(root_fd), pins_(std::move(pins)) {
  install_sigbus_handler();
  open_or_create(root_fd);
}

NameFile::~NameFile() {
  // A parent's NameFile in a forked child: its descriptors were closed at the fork.
  for (int fd : pool_) close_tracked(fd, generation_);
  if (header_) munmap(header_, sizeof(Header));
  close_tracked(fd_, generation_);
}

void NameFile::open_or_create(int root_fd) {
  const std::string state = base_ + ".s";
  for (int attempt = 0; attempt < 100; ++attempt) {
    int fd = tracked(openat(root_fd, state.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC));
    if (fd < 0) {
      if (errno == ENOENT) {
        create(root_fd);
        continue;
      }
      if (errno == ELOOP || errno == EISDIR || errno == ENXIO) {  // a symbolic link, a directory, a socket
        throw AccessDenied("refusing the state file of '" + name_ + "': not a regular file owned by this user");
      }
      fail_io("cannot open the state of '" + name_ + "'");
    }
    const auto drop = [&](void* map) {
      if (map) munmap(map, sizeof(Header));
      close_tracked(fd, generation_);
    };
    struct stat st {};
    if (fstat(fd, &st) != 0) {
      const int error = errno;
      drop(nullptr);
      fail_io("stat", error);
    }
    if (!S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
      drop(nullptr);
      throw AccessDenied("refusing the state file of '" + name_ + "': not a regular file owned by this user");
    }
    if (static_cast<std::size_t>(st.st_size) != sizeof(Header)) {
      std::uint32_t magic = 0;
      const bool ours = st.st_size < static_cast<off_t>(sizeof magic) ||
                        (pread(fd, &magic, sizeof magic, 0) == sizeof magic && magic == kMagic);
      if (!ours || st.st_size > static_cast<off_t>(sizeof(Header))) {
        drop(nullptr);
        throw BackendUnavailable("the state file of '" + name_ + "' has an unexpected size (another turnstile version?)");
      }
      // Truncated: its queue is gone. Every entry still alive holds its bytes, and its holder
      // is told by its own check; replace the file only once none is left.
      if (is_locked(fd, kByteBase, 0)) {
        drop(nullptr);
        throw BackendUnavailable("the state file of '" + name_ + "' was truncated and is still used by a live "
                                 "process (which is told its hold is lost); try again once it has let go");
      }
      drop(nullptr);
      replace(root_fd, st.st_ino, 0);
      continue;
    }
    void* map = mmap(nullptr, sizeof(Header), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
      const int error = errno;
      drop(nullptr);
      fail_io("mmap", error);
    }
    auto* header = static_cast<Header*>(map);
    std::atomic<bool> torn{false};
    enum class Verdict { ok, foreign, older_version, earlier_boot, other_name } verdict;
    std::uint64_t carried = 0;
    {
      MappingAccess access(map, sizeof(Header), torn);
      if (header->magic == kMagic && header->version == 1) {
        verdict = Verdict::older_version;  // same size and counter position; other wake-ups
        carried = header->next_seq;
        if (std::strncmp(header->boot_id, boot_id().c_str(), sizeof header->boot_id) != 0) verdict = Verdict::earlier_boot;
      } else if (header->magic != kMagic || header->version != kVersion) {
        verdict = Verdict::foreign;
      } else if (std::strncmp(header->boot_id, boot_id().c_str(), sizeof header->boot_id) != 0) {
        verdict = Verdict::earlier_boot;
        carried = header->next_seq;
      } else if (header->name_length != name_.size() || std::memcmp(header->name, name_.data(), name_.size()) != 0) {
        verdict = Verdict::other_name;
      } else {
        verdict = Verdict::ok;
      }
    }
    if (torn.load()) {  // truncated while we looked: look again
      drop(map);
      continue;
    }
    switch (verdict) {
      case Verdict::foreign:
        drop(map);
        throw BackendUnavailable("the state file of '" + name_ + "' is not a turnstile v" + std::to_string(kVersion) +
                                 " state file (another turnstile version?)");
      case Verdict::older_version:
        // Written in this boot by turnstile 1, whose waiters wake another way: a process of
        // that version may join it at any moment, so never take it over (after a reboot we do).
        drop(map);
        throw BackendUnavailable("the state file of '" + name_ + "' belongs to an older turnstile version; remove " +
                                 base_ + ".s once no process of that version uses it");
      case Verdict::earlier_boot:
        // Written before a reboot: its mutex may belong to a thread that no longer exists.
        drop(map);
        replace(root_fd, st.st_ino, carried);
        continue;
      case Verdict::other_name:
        drop(map);
        throw BackendUnavailable("the state file for '" + name_ + "' belongs to another name (hash collision)");
      case Verdict::ok:
        break;
    }
    fd_ = fd;
    header_ = header;
    dev_ = st.st_dev;
    ino_ = st.st_ino;
    return;
  }
  throw BackendUnavailable("cannot open the state of '" + name_ + "': it keeps changing");
}

// Replaces the state file whose inode is `ino` by a fresh one carrying the fencing counter, once
// (other processes may be doing the same), under a lock on the root directory.
void NameFile::replace(int root_fd, ino_t ino, std::uint64_t carried_seq) {
  const std::string state = base_ + ".s";
  if (flock(root_fd, LOCK_EX) != 0) fail_io("lock of the backend directory");
  try {
    struct stat now {};
    if (fstatat(root_fd, state.c_str(), &now, AT_SYMLINK_NOFOLLOW) == 0 && now.st_ino == ino) {
      unlinkat(root_fd, state.c_str(), 0);
      create(root_fd);
      const int fresh = tracked(openat(root_fd, state.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC));
      if (fresh >= 0) {
        if (void* m = mmap(nullptr, sizeof(Header), PROT_READ | PROT_WRITE, MAP_SHARED, fresh, 0); m != MAP_FAILED) {
          static_cast<Header*>(m)->next_seq = carried_seq;
          munmap(m, sizeof(Header));
        }
        close_tracked(fresh, generation_);
      }
    }
  } catch (...) {
    flock(root_fd, LOCK_UN);
    throw;
  }
  flock(root_fd, LOCK_UN);
}

// Builds the file aside and links it into place, so nobody ever sees it half-initialised.
void NameFile::create(int root_fd) {
  std::random_device random;
  const std::string temp = base_ + ".tmp." + std::to_string(getpid()) + "." + std::to_string(random());
  int fd = tracked(openat(root_fd, temp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (fd < 0) fail_io("cannot create the state of '" + name_ + "'");
  const auto cleanup = [&] {
    close_tracked(fd, generation_);
    unlinkat(root_fd, temp.c_str(), 0);
  };
  // ftruncate fills with zeros without writing them: only the pages we touch below use space.
  if (ftruncate(fd, sizeof(Header)) != 0) {
    int error = errno;
    cleanup();
    fail_io("ftruncate", error);
  }
  void* map = mmap(nullptr, sizeof(Header), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) {
    int error = errno;
    cleanup();
    fail_io("mmap", error);
  }
  auto* header = static_cast<Header*>(map);
  header->magic = kMagic;
  header->version = kVersion;
  std::strncpy(header->boot_id, boot_id().c_str(), sizeof header->boot_id - 1);
  pthread_mutexattr_t attributes;
  pthread_mutexattr_init(&attributes);
  pthread_mutexattr_setpshared(&attributes, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attributes, PTHREAD_MUTEX_ROBUST);
  pthread_mutex_init(&header->mutex, &attributes);
  pthread_mutexattr_destroy(&attributes);
  header->name_length = static_cast<std::uint32_t>(name_.size());
  std::memcpy(header->name, name_.data(), name_.size());
  munmap(map, sizeof(Header));
  if (pins_->pinned(pin_byte_)) {
    cleanup();
    struct stat now {};
    if (fstatat(root_fd, state_name_.c_str(), &now, AT_SYMLINK_NOFOLLOW) == 0) return;  // made meanwhile: open it
    // The name's file was removed or moved away while a process holds something of it.
    throw BackendUnavailable("the state file of '" + name_ + "' was removed while a live process still holds '" +
                             name_ + "' (it is told its hold is lost); try again once it has let go");
  }
  const bool linked = linkat(root_fd, temp.c_str(), root_fd, (base_ + ".s").c_str(), 0) == 0;
  const int error = errno;
  cleanup();
  if (!linked && error != EEXIST) fail_io("cannot publish the state of '" + name_ + "'", error);
}

void NameFile::repair() {
  // The previous owner died while changing the queue. An entry is complete when its seq is not
  // 0 (remove_at writes seq last); a seq seen twice is an entry caught mid-move, whose later
  // copy is the one never overwritten (moves go towards the front). Then drop dead entries.
  auto& h = *header_;
  if (h.count > kCapacity) h.count = kCapacity;
  std::set<std::uint64_t> seen;
  for (std::size_t i = h.count; i-- > 0;) {
    if (h.entries[i].seq == 0 || h.entries[i].seq > h.next_seq || !seen.insert(h.entries[i].seq).second) {
      remove_at(i);
    }
  }
  sweep_dead();
}

int NameFile::checkout_descriptor() {
  {
    std::lock_guard lock(pool_mutex_);
    if (!pool_.empty()) {
      int fd = pool_.back();
      pool_.pop_back();
      return fd;
    }
  }
  // Reopen through /proc so the new description is of this very file, even if the path changed.
  const std::string self = "/proc/self/fd/" + std::to_string(fd_);
  int fd = tracked(open(self.c_str(), O_RDWR | O_CLOEXEC));
  if (fd < 0) fail_io("cannot reopen the state of '" + name_ + "'");
  return fd;
}

void NameFile::return_descriptor(int fd) {
  {
    std::lock_guard lock(pool_mutex_);
    if (pool_.size() < kSpareDescriptors) {
      pool_.push_back(fd);
      return;
    }
  }
  close_tracked(fd, generation_);
}

// Under watches_mutex_.
std::shared_ptr<ByteWatch> NameFile::watch_byte(off_t offset) {
  auto& slot = watches_[offset];
  if (slot) return slot;
  auto watch = std::make_shared<ByteWatch>();
  watch->fd = checkout_descriptor();
  watch->offset = offset;
  watch->generation = generation_;
  auto* argument = new std::shared_ptr<ByteWatch>(watch);
  pthread_attr_t attributes;
  pthread_attr_init(&attributes);
  pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
  pthread_attr_setstacksize(&attributes, 256 * 1024);  // it only waits: no need for megabytes
  // The application's signals are not for this thread: it starts with all of them blocked.
  sigset_t all, previous;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &previous);
  std::lock_guard lock(watch->mutex);  // `thread` is set before anyone may cancel
  const int rc = pthread_create(&watch->thread, &attributes, run_byte_watch, argument);
  pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  pthread_attr_destroy(&attributes);
  if (rc != 0) {
    delete argument;
    close_tracked(watch->fd, generation_);
    watches_.erase(offset);
    fail_io("cannot start a thread to wait for '" + name_ + "'", rc);
  }
  slot = watch;
  return watch;
}

void NameFile::wait_for_any_release(const std::vector<off_t>& offsets, Deadline deadline, const std::stop_token& stop) {
  auto waker = std::make_shared<Waker>();
  std::vector<std::shared_ptr<ByteWatch>> watches;
  watches.reserve(offsets.size());
  const auto stop_listening = [&] {
    std::lock_guard lock(watches_mutex_);
    for (const auto& watch : watches) {
      if (watch->unlisten(waker)) continue;
      if (auto it = watches_.find(watch->offset); it != watches_.end() && it->second == watch) watches_.erase(it);
      watch->cancel();
    }
  };
  try {
    std::lock_guard lock(watches_mutex_);
    for (off_t offset : offsets) {
      watches.push_back(watch_byte(offset));
      watches.back()->listen(waker);
    }
  } catch (...) {
    stop_listening();
    throw;
  }
  {
    std::stop_callback on_stop(stop, [&] { waker->wake(); });
    waker->sleep(deadline);
  }
  stop_listening();
}

void NameFile::ring_counter() {
  ++header_->counter_epoch;
  if (header_->counter_sleepers != 0) futex_wake_all(&header_->counter_epoch);
}

std::ptrdiff_t NameFile::find(std::uint64_t seq) const {
  for (std::size_t i = 0; i < header_->count; ++i) {
    if (header_->entries[i].seq == seq) return static_cast<std::ptrdiff_t>(i);
  }
  return -1;
}

// Writes whose order matters to a process that finds our state after we were killed between
// two of them: the compiler must not reorder them (the CPU commits a dead thread's stores too).
void NameFile::append(const Entry& entry) {
  auto& h = *header_;
  h.entries[h.count] = entry;
  h.next_seq = entry.seq;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  ++h.count;  // only after the entry is written: a crash leaves no half entry
}

void NameFile::remove_at(std::size_t index) {
  // Entry by entry towards the front, each slot's seq cleared first and written last: killed at
  // any point, we leave complete entries (one possibly twice, identical) and at most one slot
  // with seq 0, which repair() drops. A memmove could leave a torn entry with a valid seq.
  auto& h = *header_;
  for (std::size_t i = index; i + 1 < h.count; ++i) {
    Entry& to = h.entries[i];
    const Entry& from = h.entries[i + 1];
    std::atomic_ref<std::uint64_t>(to.seq).store(0, std::memory_order_relaxed);
    std::atomic_signal_fence(std::memory_order_seq_cst);
    to.permits = from.permits;
    to.since_ns = from.since_ns;
    to.pid = from.pid;
    to.kind = from.kind;
    std::atomic_signal_fence(std::memory_order_seq_cst);
    std::atomic_ref<std::uint64_t>(to.seq).store(from.seq, std::memory_order_relaxed);
    std::atomic_signal_fence(std::memory_order_seq_cst);
  }
  --h.count;
}

bool NameFile::remove_if_dead(std::uint64_t seq) {
  const auto index = find(seq);
  if (index < 0 || is_locked(fd_, seq, Byte::life)) return false;
  remove_at(static_cast<std::size_t>(index));
  recompute_mode();
  return true;
}

void NameFile::sweep_dead() {
  auto& h = *header_;
  for (std::size_t i = 0; i < h.count;) {
    if (!is_locked(fd_, h.entries[i].seq, Byte::life)) {
      remove_at(i);
    } else {
      ++i;
    }
  }
  recompute_mode();
}

void NameFile::recompute_mode() {
  auto& h = *header_;
  bool any = false;
  for (std::size_t i = 0; i < h.count; ++i) any |= h.entries[i].kind != kCounterWaiter;
  if (!any) {
    h.mode = Mode::none;
    h.limit = 0;
  }
}

bool NameFile::pin_if_current() {
  pins_->pin(pin_byte_);
  struct stat now {};
  if (fstatat(root_fd_, state_name_.c_str(), &now, AT_SYMLINK_NOFOLLOW) == 0 && now.st_dev == dev_ &&
      now.st_ino == ino_) {
    return true;
  }
  pins_->unpin(pin_byte_);
  return false;
}

bool NameFile::still_valid() {
  if (broken()) return false;
  struct stat mine {}, now {};
  if (fstat(fd_, &mine) != 0 || mine.st_nlink == 0 || mine.st_size != static_cast<off_t>(sizeof(Header))) return false;
  if (fstatat(root_fd_, state_name_.c_str(), &now, AT_SYMLINK_NOFOLLOW) != 0) return false;
  if (now.st_dev != dev_ || now.st_ino != ino_) return false;
  MappingAccess access(header_, sizeof(Header), broken_);
  return header_->magic == kMagic && !broken();
}

// ---- the backend directory -----------------------------------------------------------------

std::string parent_of(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
}

// Whether only this user can be in group `gid`: our own group with no other listed member.
bool private_group(gid_t gid) {
  if (gid != getegid()) return false;
  std::vector<char> buffer(16384);
  group entry {};
  group* found = nullptr;
  if (getgrgid_r(gid, &entry, buffer.data(), buffer.size(), &found) != 0 || !found) return false;
  passwd user {};
  passwd* me = nullptr;
  std::vector<char> user_buffer(16384);
  if (getpwuid_r(geteuid(), &user, user_buffer.data(), user_buffer.size(), &me) != 0 || !me) return false;
  for (char** member = found->gr_mem; *member; ++member) {
    if (std::strcmp(*member, me->pw_name) != 0) return false;
  }
  return true;
}

void check_above(const std::string& root, const std::string& dir) {
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0) fail_io("cannot look at " + dir);
  const bool writable = (st.st_mode & S_IWOTH) || ((st.st_mode & S_IWGRP) && !private_group(st.st_gid));
  if (writable && !(st.st_mode & S_ISVTX)) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    throw AccessDenied("refusing " + root + ": " + dir + " above it may be written by its group or others (mode " +
                       mode + ", no sticky bit), who could rename it away and put another in its place; "
                       "chmod go-w or +t " + dir + ", or use another directory");
  }
}

// `dir` and every directory above it, along the path given and along the real one (symbolic
// links among them are followed, as by any program): one that others may write to without the
// sticky bit lets them rename the backend directory (or one above it) away and put their own in
// its place, so it is refused (AccessDenied). A sticky one (/tmp) lets only owners rename.
void check_ancestors(const std::string& root, const std::string& dir) {
  std::vector<std::string> paths{dir};
  char real[PATH_MAX] = {};
  if (realpath(dir.c_str(), real) != nullptr && real != dir) paths.emplace_back(real);
  for (const auto& path : paths) {
    for (std::string at = path;; at = parent_of(at)) {
      check_above(root, at);
      if (at == "/") break;
    }
  }
}

// Opens the backend directory, creating missing parts private to this user, but only inside a
// directory owned by this user or by root: root with a user's XDG_RUNTIME_DIR (sudo -E) must not
// plant a root-owned directory that locks the user out. Refuses a symbolic link, a
// non-directory, a directory owned by someone else, or one its group or others may write to
// (they could remove or replace the state files). Refusals are AccessDenied.
int open_root(const std::string& root) {
  bool checked = false;
  for (std::size_t slash = 1; slash != std::string::npos;) {
    slash = root.find('/', slash + 1);
    const std::string prefix = root.substr(0, slash);
    struct stat st {};
    if (lstat(prefix.c_str(), &st) == 0) continue;
    if (errno != ENOENT) fail_io("cannot look at " + prefix);
    const std::string parent = parent_of(prefix);
    struct stat up {};
    if (stat(parent.c_str(), &up) != 0) fail_io("cannot look at " + parent);
    if (up.st_uid != geteuid() && up.st_uid != 0) {
      throw AccessDenied("refusing to create " + prefix + " inside " + parent + ", which belongs to uid " +
                         std::to_string(up.st_uid) + " (this is uid " + std::to_string(geteuid()) + ")");
    }
    if (!checked) check_ancestors(root, parent);  // before creating anything
    checked = true;
    if (mkdir(prefix.c_str(), 0700) != 0 && errno != EEXIST) fail_io("cannot create " + prefix);
  }
  int fd = tracked(open(root.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (fd < 0) {
    if (errno == ELOOP || errno == ENOTDIR) {
      throw AccessDenied("refusing " + root + ": it is a symbolic link or not a directory");
    }
    fail_io("cannot open " + root);
  }
  const auto generation = current_generation();
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    int error = errno;
    close_tracked(fd, generation);
    fail_io("stat " + root, error);
  }
  if (st.st_uid != geteuid()) {
    close_tracked(fd, generation);
    throw AccessDenied("refusing " + root + ": it is owned by uid " + std::to_string(st.st_uid) +
                       ", not by this user (uid " + std::to_string(geteuid()) + ")");
  }
  if (st.st_mode & (S_IWGRP | S_IWOTH)) {
    close_tracked(fd, generation);
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    throw AccessDenied("refusing " + root + ": its group or others may write to it (mode " + mode +
                       "); make it private (chmod go-w) or use another directory");
  }
  try {
    check_ancestors(root, parent_of(root));
  } catch (...) {
    close_tracked(fd, generation);
    throw;
  }
  return fd;
}

// Whether a state file we hold open was removed from the tree, or is no longer whole.
bool stale(int fd) {
  struct stat st {};
  return fstat(fd, &st) != 0 || st.st_nlink == 0 || st.st_size != static_cast<off_t>(sizeof(Header));
}

bool unlinked_dir(int fd) {
  struct stat st {};
  return fstat(fd, &st) != 0 || st.st_nlink == 0;
}

class FileHold;

class FileBackend final : public Backend {
 public:
  FileBackend(std::string root, int root_fd) : root_(std::move(root)), root_fd_(root_fd) {
    auto& r = registry();
    std::lock_guard lock(r.backends_mutex);
    r.backends.push_back(this);
  }
  ~FileBackend() override {
    {
      auto& r = registry();
      std::lock_guard lock(r.backends_mutex);
      std::erase(r.backends, this);
    }
    {
      // No join: waiting for the watcher to be scheduled just to see the stop costs a short
      // process (turnstile run) milliseconds on a busy machine. It exits on its own when it
      // next wakes, touching only the shared state; a check in progress uses our directory
      // descriptor, so that one we let finish.
      std::unique_lock lock(watch_->mutex);
      watch_->stop = true;
      watch_->cv.notify_all();
      // (Unless we are that check: a loss callback that dropped the last Client; or the
      // watcher is a parent's thread, which a forked child does not have.)
      if (watch_->thread != std::this_thread::get_id() && watch_->generation == current_generation()) {
        watch_->cv.wait(lock, [&] { return !watch_->checking; });
      }
    }
    files_.clear();
    close_tracked(root_fd_, generation_);
    for (int fd : removed_root_fds_) close_tracked(fd, generation_);
  }

  std::unique_ptr<BackendHold> acquire(const QueueRequest& request, Deadline deadline,
                                       std::shared_ptr<LossSignal> loss) override;
  // One attempt in one state file; sets `moved` when admitted in a file no longer at its path.
  std::unique_ptr<BackendHold> acquire_in(const std::shared_ptr<NameFile>& name_file, const QueueRequest& request,
                                          Deadline deadline, const std::shared_ptr<LossSignal>& loss, bool& moved);
  Inspection inspect(const std::string& name) override;
  bool counter_try_set(const std::string& name, std::int64_t permits) override;
  std::int64_t counter_add(const std::string& name, std::int64_t delta) override;
  std::optional<std::int64_t> counter_get(const std::string& name) override;
  std::int64_t counter_drain(const std::string& name) override;
  bool counter_acquire(const std::string& name, std::int64_t permits, Deadline deadline) override;

  void watch(FileHold* hold);
  void unwatch(FileHold* hold);

  // The fork handlers: the child must find these mutexes unlocked and the state they guard whole.
  void lock_for_fork() {
    files_mutex_.lock();
    watch_->mutex.lock();
  }
  void unlock_after_fork() {
    watch_->mutex.unlock();
    files_mutex_.unlock();
  }

 private:
  std::shared_ptr<NameFile> file(const std::string& name);
  void reopen_root_if_removed();
  // Forgets `nf` (no longer the file at its path): the next file(name) opens the current one.
  void forget(const std::string& name, const std::shared_ptr<NameFile>& nf);
  struct WatchState;
  static void watch_loop(const std::shared_ptr<WatchState>& state);

  std::string root_;
  int root_fd_;
  std::uint32_t generation_ = current_generation();
  std::vector<int> removed_root_fds_;  // still named by NameFiles that outlive their directory
  std::shared_ptr<DirectoryPins> pins_ = std::make_shared<DirectoryPins>(root_fd_);
  std::mutex files_mutex_;
  std::unordered_map<std::string, std::shared_ptr<NameFile>> files_;

  // The watcher's state, shared with its thread, which may outlive the backend (see above).
  struct WatchState {
    std::mutex mutex;
    std::condition_variable cv;
    // An intrusive list through the holds themselves: watching costs no allocation per acquire.
    FileHold* holds = nullptr;
    bool started = false;
    bool stop = false;
    bool checking = false;  // the thread is checking files, outside the mutex
    std::thread::id thread;
    std::uint32_t generation = current_generation();  // of the thread (a child has none)
  };
  std::shared_ptr<WatchState> watch_ = std::make_shared<WatchState>();
};

ForkRegistry& registry() {
  static ForkRegistry* const instance = [] {
    auto* r = new ForkRegistry;  // never destroyed: fork handlers and exit-time destructors use it
    pthread_atfork(
        [] {
          auto& reg = registry();
          reg.backends_mutex.lock();
          for (auto* backend : reg.backends) backend->lock_for_fork();
          reg.fds_mutex.lock();
        },
        [] {
          auto& reg = registry();
          reg.fds_mutex.unlock();
          for (auto it = reg.backends.rbegin(); it != reg.backends.rend(); ++it) (*it)->unlock_after_fork();
          reg.backends_mutex.unlock();
        },
        [] {
          auto& reg = registry();
          // The parent's descriptions stay the parent's: a child that shared one could convert
          // or drop the parent's locks with its own, and one that kept them would keep the
          // parent's holds alive after the parent died.
          for (int fd : reg.fds) close(fd);
          reg.fds.clear();
          fork_generation.fetch_add(1, std::memory_order_relaxed);
          cached_pid.store(0, std::memory_order_relaxed);
          reg.fds_mutex.unlock();
          for (auto it = reg.backends.rbegin(); it != reg.backends.rend(); ++it) (*it)->unlock_after_fork();
          reg.backends_mutex.unlock();
        });
    return r;
  }();
  return *instance;
}

class FileHold final : public BackendHold {
 public:
  FileHold(FileBackend& backend, std::shared_ptr<NameFile> file, int fd, std::uint64_t seq, EntryKind kind,
           std::shared_ptr<LossSignal> loss)
      : backend_(backend), file_(std::move(file)), fd_(fd), seq_(seq), kind_(kind), loss_(std::move(loss)) {
    try {
      backend_.watch(this);
    } catch (...) {
      file_->unpin();  // taken for this hold by pin_if_current()
      throw;
    }
  }
  ~FileHold() override {
    try {
      release();
    } catch (...) {
    }
  }

  std::uint64_t fencing_token() const override { return seq_; }

  void downgrade() override {
    if (fd_ < 0 || kind_ != EntryKind::exclusive) return;
    refuse_if_inherited();
    NameFile::Guard guard(*file_);
    if (auto index = file_->find(seq_); index >= 0) {
      file_->header().entries[index].kind = static_cast<std::uint8_t>(EntryKind::shared);
    }
    kind_ = EntryKind::shared;
    set_lock(fd_, F_UNLCK, byte_offset(seq_, Byte::exclusive), 1, false);  // readers behind wake
  }

  void release() override {
    if (fd_ < 0) return;
    refuse_if_inherited();
    backend_.unwatch(this);
    bool found = false;
    bool broken;
    {
      NameFile::Guard guard(*file_);
      broken = file_->broken();
      if (!broken) {
        const auto index = file_->find(seq_);
        found = index >= 0;
        if (found) file_->remove_at(static_cast<std::size_t>(index));
        file_->recompute_mode();
      }
      // This description holds only this entry's bytes: unlocking the whole file drops the
      // same locks, and the kernel skips allocating the two lock records that splitting a
      // range may need (a ranged unlock allocates them on every call).
      set_lock(fd_, F_UNLCK, 0, 0, false);
    }
    file_->return_descriptor(fd_);
    fd_ = -1;
    file_->unpin();
    if (broken) {
      loss_->lose("the state file of '" + file_->name() + "' was truncated or overwritten");
    } else if (!found) {
      loss_->lose("its entry vanished from the state file");
    }
  }

  const std::shared_ptr<NameFile>& file() const { return file_; }
  const std::shared_ptr<LossSignal>& loss() const { return loss_; }

 private:
  friend class FileBackend;

  // A hold inherited through fork() is the parent's: the child never touches its entry or its
  // description (closed in the child at the fork).
  void refuse_if_inherited() {
    if (file_->generation() == current_generation()) return;
    fd_ = -1;
    throw HoldLost("the hold on '" + file_->name() + "' (fencing token " + std::to_string(seq_) +
                   ") belongs to the process that forked this one: a child neither holds nor releases it");
  }

  FileHold* watch_prev_ = nullptr;  // FileBackend::WatchState::holds, under its mutex
  FileHold* watch_next_ = nullptr;
  FileBackend& backend_;
  std::shared_ptr<NameFile> file_;
  int fd_;
  std::uint64_t seq_;
  EntryKind kind_;
  std::shared_ptr<LossSignal> loss_;
};

// Under files_mutex_.
void FileBackend::reopen_root_if_removed() {
  if (!unlinked_dir(root_fd_)) return;
  const int fresh = open_root(root_);
  removed_root_fds_.push_back(root_fd_);
  root_fd_ = fresh;
  pins_ = std::make_shared<DirectoryPins>(root_fd_);
}

std::shared_ptr<NameFile> FileBackend::file(const std::string& name) {
  std::lock_guard lock(files_mutex_);
  if (generation_ != current_generation()) {
    // In a forked child: the parent's files and descriptors are not ours (see the fork handlers).
    files_.clear();
    removed_root_fds_.clear();
    root_fd_ = -1;
    root_fd_ = open_root(root_);
    pins_ = std::make_shared<DirectoryPins>(root_fd_);
    generation_ = current_generation();
  }
  auto& slot = files_[name];
  // A state file removed, replaced or truncated under us (rm -rf, a tmp cleaner) no longer
  // excludes anyone: use the one now at the path, never the orphan. Holds on the orphan keep it
  // alive and are told by the watcher that they may be lost.
  if (slot && (slot->broken() || stale(slot->probe_fd()))) {
    slot.reset();
    reopen_root_if_removed();
  }
  if (slot) return slot;
  try {
    slot = std::make_shared<NameFile>(root_fd_, pins_, name);
  } catch (...) {
    files_.erase(name);
    throw;
  }
  auto result = slot;
  if (files_.size() > kIdleNames) {
    // Close the names nobody holds or waits for (only this map refers to them).
    std::erase_if(files_, [&](const auto& item) { return item.second.use_count() == 1 && item.first != name; });
  }
  return result;
}

void FileBackend::forget(const std::string& name, const std::shared_ptr<NameFile>& nf) {
  std::lock_guard lock(files_mutex_);
  if (auto it = files_.find(name); it != files_.end() && it->second == nf) {
    files_.erase(it);
    reopen_root_if_removed();
  }
}

void FileBackend::watch(FileHold* hold) {
  std::lock_guard lock(watch_->mutex);
  if (watch_->generation != current_generation()) {
    // A forked child: the parent's holds are not ours to watch, and its thread is not here.
    watch_->holds = nullptr;
    watch_->started = false;
    watch_->checking = false;
    watch_->generation = current_generation();
  }
  hold->watch_prev_ = nullptr;
  hold->watch_next_ = watch_->holds;
  if (watch_->holds) watch_->holds->watch_prev_ = hold;
  watch_->holds = hold;
  if (!watch_->started) {
    std::thread watcher([state = watch_] { watch_loop(state); });
    watch_->thread = watcher.get_id();
    watcher.detach();
    watch_->started = true;
  }
}

void FileBackend::unwatch(FileHold* hold) {
  std::lock_guard lock(watch_->mutex);
  if (hold->watch_prev_) {
    hold->watch_prev_->watch_next_ = hold->watch_next_;
  } else if (watch_->holds == hold) {
    watch_->holds = hold->watch_next_;
  } else {
    return;  // not in the list
  }
  if (hold->watch_next_) hold->watch_next_->watch_prev_ = hold->watch_prev_;
  hold->watch_prev_ = hold->watch_next_ = nullptr;
}

// The embedded backend's keep-alive: the kernel keeps our locks for as long as we live, but a
// state file removed, replaced or truncated under us (rm -rf, a tmp cleaner) no longer
// excludes anyone.
void FileBackend::watch_loop(const std::shared_ptr<WatchState>& state) {
  std::unique_lock lock(state->mutex);
  for (;;) {
    state->cv.wait_for(lock, std::chrono::milliseconds(500), [&] { return state->stop; });
    if (state->stop) return;
    std::vector<std::pair<std::shared_ptr<NameFile>, std::shared_ptr<LossSignal>>> holds;
    for (auto* hold = state->holds; hold; hold = hold->watch_next_) holds.emplace_back(hold->file(), hold->loss());
    state->checking = true;
    lock.unlock();  // lose() runs the user's callback, which may release holds
    for (const auto& [file, loss] : holds) {
      if (!loss->lost() && !file->still_valid()) {
        loss->lose("the state file of '" + file->name() + "' was removed, replaced or truncated");
      }
    }
    holds.clear();
    lock.lock();
    state->checking = false;
    state->cv.notify_all();
  }
}

std::unique_ptr<BackendHold> FileBackend::acquire(const QueueRequest& request, Deadline deadline,
                                                  std::shared_ptr<LossSignal> loss) {
  for (;;) {
    auto name_file = file(request.name);
    bool moved = false;
    auto hold = acquire_in(name_file, request, deadline, loss, moved);
    if (!moved) return hold;
    // Admitted in a state file removed or moved away meanwhile (our entry has left it): that
    // admission excludes nobody, so queue again in the file now at the path.
    forget(request.name, name_file);
  }
}

std::unique_ptr<BackendHold> FileBackend::acquire_in(const std::shared_ptr<NameFile>& name_file,
                                                     const QueueRequest& request, Deadline deadline,
                                                     const std::shared_ptr<LossSignal>& loss, bool& moved) {
  NameFile& nf = *name_file;
  const int fd = nf.checkout_descriptor();
  std::uint64_t seq = 0;
  // A passed deadline and a requested stop both end the wait: the entry leaves, nullptr.
  const auto give_up = [&] { return request.stop.stop_requested() || (deadline && *deadline <= SteadyClock::now()); };
  const auto leave = [&] {
    const auto index = nf.find(seq);
    if (index >= 0) nf.remove_at(static_cast<std::size_t>(index));
    nf.recompute_mode();
    set_lock(fd, F_UNLCK, byte_offset(seq, Byte::life), 4, false);
  };
  // Outside the guard: a hold is handed out only once its name is pinned in a file still in place.
  const auto admit = [&]() -> std::unique_ptr<BackendHold> {
    if (nf.pin_if_current()) return std::make_unique<FileHold>(*this, name_file, fd, seq, request.kind, loss);
    {
      NameFile::Guard guard(nf);
      leave();
    }
    nf.return_descriptor(fd);
    moved = true;
    return nullptr;
  };
  try {
    bool admitted_at_join = false;
    {
      NameFile::Guard guard(nf);
      nf.check_intact();
      auto& h = nf.header();
      const auto mode_text = [&] {
        return h.mode == Mode::lock ? QueueMode::lock : h.mode == Mode::semaphore ? QueueMode::semaphore : QueueMode::none;
      };
      try {
        check_queue_mode(request, mode_text(), h.limit);
      } catch (const Error&) {
        nf.sweep_dead();  // the entries that set the mode may belong to dead processes
        check_queue_mode(request, mode_text(), h.limit);
      }
      if (h.count == kCapacity) nf.sweep_dead();
      if (h.count == kCapacity) {
        throw QueueFull("'" + request.name + "' already has " + std::to_string(kCapacity) + " contenders");
      }
      const std::uint64_t next = next_token(h);
      const auto admitted_at_tail = [&] {
        // Reused per thread: no allocation on the uncontended path.
        thread_local std::vector<QueueEntryView> views;
        views.clear();
        for (std::size_t i = 0; i < h.count; ++i) {
          if (h.entries[i].kind != kCounterWaiter) {
            views.push_back({static_cast<EntryKind>(h.entries[i].kind), h.entries[i].permits});
          }
        }
        views.push_back({request.kind, request.permits});
        return evaluate_queue(views, views.size() - 1, request.limit).admitted();
      };
      bool admitted = admitted_at_tail();
      if (!admitted && give_up()) {
        // Try-once: nobody will wake us, so check that those ahead are alive before failing.
        nf.sweep_dead();
        admitted = admitted_at_tail();
        if (!admitted) {
          nf.check_intact();
          nf.return_descriptor(fd);
          return nullptr;  // nothing joined, nothing to undo
        }
      }
      // life, then exclusive for writers, then waiting for leases still in line
      const off_t length = request.kind == EntryKind::lease ? (admitted ? 1 : 3) : request.kind == EntryKind::exclusive ? 2 : 1;
      if (request.kind == EntryKind::lease && !admitted) {
        set_lock(fd, F_WRLCK, byte_offset(next, Byte::life), 1, false);
        set_lock(fd, F_WRLCK, byte_offset(next, Byte::waiting), 1, false);
      } else {
        set_lock(fd, F_WRLCK, byte_offset(next, Byte::life), length, false);
      }
      seq = next;
      nf.append(Entry{seq, request.permits, realtime_ns(), my_pid(), static_cast<std::uint8_t>(request.kind), {}});
      if (h.mode == Mode::none) {
        h.mode = request.kind == EntryKind::lease ? Mode::semaphore : Mode::lock;
        h.limit = request.kind == EntryKind::lease ? request.limit : 0;
      }
      nf.check_intact();
      admitted_at_join = admitted;
    }
    if (admitted_at_join) return admit();
    // Wait in line: sleep on whatever can change our verdict, then look again.
    for (;;) {
      std::vector<off_t> bytes;
      std::uint64_t target = 0;
      bool admitted = false;
      {
        NameFile::Guard guard(nf);
        nf.check_intact();
        auto& h = nf.header();
        std::vector<QueueEntryView> views;
        std::vector<std::uint64_t> seqs;
        std::size_t mine = 0;
        bool found = false;
        for (std::size_t i = 0; i < h.count; ++i) {
          const auto& e = h.entries[i];
          if (e.kind == kCounterWaiter) continue;
          if (e.seq == seq) {
            mine = views.size();
            found = true;
          }
          views.push_back({static_cast<EntryKind>(e.kind), e.permits});
          seqs.push_back(e.seq);
          if (found) break;
        }
        if (!found) throw HoldLost("the queue entry of '" + request.name + "' vanished while waiting");
        const Verdict verdict = evaluate_queue(views, mine, request.limit);
        admitted = verdict.admitted();
        if (admitted) {
          if (request.kind == EntryKind::lease) set_lock(fd, F_UNLCK, byte_offset(seq, Byte::waiting), 1, false);
        } else if (give_up()) {
          leave();
          nf.return_descriptor(fd);
          return nullptr;
        } else if (verdict.wait == WaitFor::any_holder_leave) {
          // Every entry ahead holds and none is enough alone: any of them leaving or dying can
          // admit us, so watch all their life bytes (the kernel's word, never a process id).
          // Dead ones first: their bytes are free already.
          bool swept = false;
          for (std::size_t i = 0; i < mine; ++i) swept |= nf.remove_if_dead(seqs[i]);
          if (swept) continue;
          for (std::size_t i = 0; i < mine; ++i) bytes.push_back(byte_offset(seqs[i], Byte::life));
        } else {
          target = seqs[verdict.index];
          const Byte which = verdict.wait == WaitFor::leave ? Byte::life
                             : verdict.wait == WaitFor::exclusive_end ? Byte::exclusive
                                                                      : Byte::waiting;
          bytes.push_back(byte_offset(target, which));
        }
      }
      if (admitted) return admit();
      if (bytes.size() == 1 && !deadline && !request.stop.stop_possible()) {
        // Nothing else can end this wait: block in the kernel on our own description.
        set_lock(fd, F_RDLCK, bytes.front(), 1, true);
        set_lock(fd, F_UNLCK, bytes.front(), 1, false);
      } else {
        nf.wait_for_any_release(bytes, deadline, request.stop);
      }
      if (target != 0) {
        NameFile::Guard guard(nf);
        nf.remove_if_dead(target);  // released by death rather than by leaving
      }
    }
  } catch (...) {
    if (seq != 0) {
      try {
        NameFile::Guard guard(nf);
        leave();
      } catch (...) {
      }
    }
    nf.return_descriptor(fd);
    throw;
  }
}

Inspection FileBackend::inspect(const std::string& name) {
  auto nf = file(name);
  NameFile::Guard guard(*nf);
  nf->sweep_dead();
  auto& h = nf->header();
  Inspection result;
  result.name = name;
  result.mode = h.mode == Mode::lock ? "lock" : h.mode == Mode::semaphore ? "semaphore" : "";
  result.limit = h.limit;
  if (h.counter_set) result.permits = h.counter;
  std::vector<QueueEntryView> views;
  for (std::size_t i = 0; i < h.count; ++i) {
    const auto& e = h.entries[i];
    EntryInfo info;
    info.fencing_token = e.seq;
    info.permits = e.permits;
    info.pid = e.pid;
    info.host = host_name();
    info.since = std::chrono::system_clock::time_point(
        std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::nanoseconds(e.since_ns)));
    if (e.kind == kCounterWaiter) {
      info.kind = "permits";
      result.waiters.push_back(info);
      continue;
    }
    info.kind = to_string(static_cast<EntryKind>(e.kind));
    views.push_back({static_cast<EntryKind>(e.kind), e.permits});
    info.holding = evaluate_queue(views, views.size() - 1, h.limit).admitted();
    (info.holding ? result.holders : result.waiters).push_back(info);
  }
  nf->check_intact();
  return result;
}

bool FileBackend::counter_try_set(const std::string& name, std::int64_t permits) {
  auto nf = file(name);
  NameFile::Guard guard(*nf);
  auto& h = nf->header();
  if (h.counter_set) {
    nf->check_intact();
    return false;
  }
  h.counter = permits;
  h.counter_set = 1;
  nf->ring_counter();
  nf->check_intact();
  return true;
}

std::int64_t FileBackend::counter_add(const std::string& name, std::int64_t delta) {
  auto nf = file(name);
  NameFile::Guard guard(*nf);
  auto& h = nf->header();
  const std::int64_t current = h.counter_set ? h.counter : 0;
  std::int64_t updated;
  if (__builtin_add_overflow(current, delta, &updated) || updated > max_permits || updated < -max_permits) {
    throw InvalidArgument("PermitCounter '" + name + "': adding " + std::to_string(delta) + " to " +
                          std::to_string(current) + " would leave the count outside -" + std::to_string(max_permits) +
                          ".." + std::to_string(max_permits) + "; nothing changed");
  }
  h.counter = updated;
  h.counter_set = 1;
  if (delta > 0) nf->ring_counter();
  nf->check_intact();
  return updated;
}

std::optional<std::int64_t> FileBackend::counter_get(const std::string& name) {
  auto nf = file(name);
  NameFile::Guard guard(*nf);
  auto& h = nf->header();
  std::optional<std::int64_t> value;
  if (h.counter_set) value = h.counter;
  nf->check_intact();
  return value;
}

std::int64_t FileBackend::counter_drain(const std::string& name) {
  auto nf = file(name);
  NameFile::Guard guard(*nf);
  auto& h = nf->header();
  if (!h.counter_set) return 0;
  const auto drained = h.counter;
  h.counter = 0;
  nf->check_intact();
  return drained;
}

// Counter waiters queue in arrival order: the first sleeps on the futex word that adders bump,
// the others on their predecessor's life byte.
bool FileBackend::counter_acquire(const std::string& name, std::int64_t permits, Deadline deadline) {
  auto name_file = file(name);
  NameFile& nf = *name_file;
  std::uint64_t seq = 0;
  int fd = -1;
  const auto leave = [&] {
    const auto index = nf.find(seq);
    if (index >= 0) nf.remove_at(static_cast<std::size_t>(index));
    set_lock(fd, F_UNLCK, byte_offset(seq, Byte::life), 4, false);
    nf.return_descriptor(fd);
    fd = -1;
  };
  try {
    for (;;) {
      std::uint64_t predecessor = 0;
      std::uint32_t epoch = 0;
      {
        NameFile::Guard guard(nf);
        nf.check_intact();
        auto& h = nf.header();
        bool first = true;
        for (std::size_t i = 0; i < h.count && h.entries[i].seq != seq; ++i) {
          if (h.entries[i].kind == kCounterWaiter) {
            first = false;
            predecessor = h.entries[i].seq;
          }
        }
        if (seq != 0 && nf.find(seq) < 0) throw HoldLost("the PermitCounter queue entry of '" + name + "' vanished");
        if (first && h.counter_set && h.counter >= permits) {
          h.counter -= permits;
          if (seq != 0) leave();
          nf.check_intact();
          return true;
        }
        if (deadline && *deadline <= SteadyClock::now()) {
          if (seq == 0 && !first) {
            nf.sweep_dead();  // a dead waiter ahead would make try_acquire fail forever
            if (nf.header().counter_set && nf.header().counter >= permits &&
                std::none_of(h.entries, h.entries + h.count, [](const Entry& e) { return e.kind == kCounterWaiter; })) {
              h.counter -= permits;
              nf.check_intact();
              return true;
            }
          }
          if (seq != 0) leave();
          return false;
        }
        if (seq == 0) {
          if (h.count == kCapacity) nf.sweep_dead();
          if (h.count == kCapacity) throw QueueFull("'" + name + "' already has " + std::to_string(kCapacity) + " waiters");
          fd = nf.checkout_descriptor();
          const std::uint64_t next = next_token(h);
          set_lock(fd, F_WRLCK, byte_offset(next, Byte::life), 1, false);
          seq = next;
          nf.append(Entry{seq, permits, realtime_ns(), my_pid(), kCounterWaiter, {}});
          continue;  // look again as a member of the queue
        }
        if (first) {
          ++h.counter_sleepers;
          epoch = h.counter_epoch;
        }
      }
      if (predecessor == 0) {
        futex_wait(&nf.header().counter_epoch, epoch, deadline);
        NameFile::Guard guard(nf);
        --nf.header().counter_sleepers;
      } else {
        const off_t byte = byte_offset(predecessor, Byte::life);
        if (deadline) {
          nf.wait_for_any_release({byte}, deadline, {});
        } else {
          set_lock(fd, F_RDLCK, byte, 1, true);
          set_lock(fd, F_UNLCK, byte, 1, false);
        }
        NameFile::Guard guard(nf);
        nf.remove_if_dead(predecessor);
      }
    }
  } catch (...) {
    if (fd >= 0) {
      try {
        NameFile::Guard guard(nf);
        leave();
      } catch (...) {
      }
    }
    throw;
  }
}

}  // namespace

std::unique_ptr<Backend> make_file_backend(const BackendUrl& url, const ClientOptions&) {
  if (!url.hosts.empty() && url.hosts != std::vector<std::string>{"localhost"}) {
    throw InvalidUrl("file:// URLs name a local directory by absolute path, e.g. file:///run/turnstile; got '" +
                     url.text + "'");
  }
  if (url.path.empty() || url.path.front() != '/') {
    throw InvalidUrl("file:// URL '" + url.text + "' has no absolute directory path");
  }
  if (!url.query.empty()) {
    throw InvalidUrl("file:// URLs take no parameters; got '?" + url.query.begin()->first + "=...'");
  }
  if (!url.user.empty()) throw InvalidUrl("file:// URLs take no user name");
  // A directory is named one way only: '.' and '..' would create directories along the way.
  for (std::size_t start = 1; start < url.path.size();) {
    const auto end = std::min(url.path.find('/', start), url.path.size());
    const auto segment = url.path.substr(start, end - start);
    if (segment == "." || segment == "..") {
      throw InvalidUrl("file:// URL '" + url.text + "' has a '.' or '..' segment; give the directory's plain path");
    }
    start = end + 1;
  }
  std::string root = url.path;
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  // State files belong in a directory of their own, never among the system's (as root, nothing
  // else would stop file:///etc).
  static const std::set<std::string> system_directories{
      "/",         "/bin",      "/boot",      "/dev",      "/dev/shm",  "/etc",       "/home",     "/lib",
      "/lib32",    "/lib64",    "/libx32",    "/media",    "/mnt",      "/opt",       "/proc",     "/root",
      "/run",      "/run/lock", "/run/user",  "/sbin",     "/srv",      "/sys",       "/tmp",      "/usr",
      "/usr/bin",  "/usr/lib",  "/usr/local", "/usr/sbin", "/usr/share", "/var",      "/var/cache", "/var/lib",
      "/var/lock", "/var/log",  "/var/run",   "/var/spool", "/var/tmp"};
  if (system_directories.count(root) != 0) {
    throw InvalidUrl("file:// URL '" + url.text + "' names the system directory " + root +
                     "; give a directory of its own, e.g. file:///run/turnstile");
  }
  const int fd = open_root(root);
  return std::make_unique<FileBackend>(root, fd);
}

}  // namespace turnstile::detail
