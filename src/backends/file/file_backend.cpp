// The embedded backend: processes and threads of one host, no server.
//
// Each name has a small state file under the root directory, mapped into every process that
// uses it. Its header holds a process-shared robust mutex, the fencing counter and the queue
// (an array of entries in arrival order). Liveness never comes from clocks: every entry owns
// open-file-description (OFD) locks on bytes of the state file far beyond its end, at an
// offset derived from its unique sequence number, and the kernel drops them when the process
// dies. A waiter blocks on exactly the byte whose release can change its verdict:
//   life byte       held while the entry exists       (mutex and writer waits)
//   exclusive byte  held while the entry is a writer  (reader waits; dropped on downgrade)
//   waiting byte    held while a lease waits          (the next lease in line waits on it)
// The one wait that no single byte expresses, "any of the lease holders ahead leaves", sleeps
// in poll() on a per-name FIFO that releasers write to, plus a pidfd per holder process, so a
// holder that dies wakes it too. Nothing polls on a timer.
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <unordered_map>

#include "core/backend.hpp"

namespace turnstile::detail {
namespace {

constexpr std::uint32_t kMagic = 0x54534C31;  // "TSL1"
constexpr std::uint32_t kVersion = 1;
constexpr std::size_t kCapacity = 1024;
constexpr std::size_t kMaxName = 256;
constexpr off_t kByteBase = off_t{1} << 40;
constexpr std::uint8_t kCounterWaiter = 9;  // an entry of the PermitCounter's own queue

enum class Byte : off_t { life = 0, exclusive = 1, waiting = 2 };

off_t byte_offset(std::uint64_t seq, Byte which) {
  return kByteBase + static_cast<off_t>(seq) * 4 + static_cast<off_t>(which);
}

enum class Mode : std::uint32_t { none = 0, lock = 1, semaphore = 2 };

struct Entry {
  std::uint64_t seq;
  std::int64_t permits;
  std::int64_t since_ns;  // CLOCK_REALTIME, for inspect
  std::int32_t pid;
  std::uint8_t kind;      // EntryKind or kCounterWaiter
  std::uint8_t reserved[3];
};

struct Header {
  std::uint32_t magic;
  std::uint32_t version;
  char boot_id[40];  // a file from an earlier boot may hold a mutex owned by a dead thread
  pthread_mutex_t mutex;
  std::uint64_t next_seq;  // the last fencing token handed out
  std::int64_t limit;
  Mode mode;
  std::uint32_t lease_sleepers;    // head lease waiters sleeping on the lease FIFO
  std::uint32_t counter_sleepers;  // head counter waiters sleeping on the counter FIFO
  std::uint32_t counter_set;
  std::int64_t counter;
  std::uint32_t name_length;
  char name[kMaxName];
  std::uint32_t count;
  Entry entries[kCapacity];
};

[[noreturn]] void fail_io(const std::string& what, int error = errno) {
  throw BackendUnavailable(what + ": " + std::strerror(error));
}

// getpid() is a real system call (glibc no longer caches it) and every join records the pid:
// cache it, and forget it in a forked child, which must record its own.
std::atomic<pid_t> cached_pid{0};

pid_t my_pid() {
  pid_t pid = cached_pid.load(std::memory_order_relaxed);
  if (pid == 0) {
    [[maybe_unused]] static const int registered =
        pthread_atfork(nullptr, nullptr, [] { cached_pid.store(0, std::memory_order_relaxed); });
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

// File names: safe bytes kept, everything else (including '/') percent-encoded, so no name
// can traverse or collide; long names fall back to a hash checked against the stored name.
std::string encode_name(const std::string& name) {
  std::string out;
  for (unsigned char c : name) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.') {
      out += static_cast<char>(c);
    } else {
      char buffer[4];
      std::snprintf(buffer, sizeof buffer, "%%%02X", c);
      out += buffer;
    }
  }
  if (out.size() <= 200) return "n." + out;
  std::uint64_t hash = 1469598103934665603ULL;  // FNV-1a
  for (unsigned char c : name) hash = (hash ^ c) * 1099511628211ULL;
  char prefix[24];
  std::snprintf(prefix, sizeof prefix, "h.%016llx.", static_cast<unsigned long long>(hash));
  return prefix + out.substr(0, 180);
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

// Whether someone holds the byte: tested from a descriptor that never holds locks itself.
bool is_locked(int probe_fd, std::uint64_t seq, Byte which) {
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = byte_offset(seq, which);
  fl.l_len = 1;
  if (fcntl(probe_fd, F_OFD_GETLK, &fl) != 0) fail_io("file lock test");
  return fl.l_type != F_UNLCK;
}

class FileBackend;

// One name's state file, open in this process.
class NameFile {
 public:
  NameFile(int root_fd, std::string name);
  ~NameFile();

  // Holds the robust mutex; repairs the state when its last owner died inside.
  class Guard {
   public:
    explicit Guard(NameFile& file);
    ~Guard() { pthread_mutex_unlock(&file_.header_->mutex); }
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;

   private:
    NameFile& file_;
  };

  Header& header() { return *header_; }
  const std::string& name() const { return name_; }
  int probe_fd() const { return fd_; }
  // A fresh open file description for one contender: OFD locks of one description never
  // conflict with each other, so contenders in one process must not share one.
  int checkout_descriptor();
  void return_descriptor(int fd);
  int fifo(bool counter);
  void wake(bool counter);   // under the guard
  void drain(bool counter);  // under the guard

  struct ByteWatch {
    std::mutex mutex;
    std::condition_variable released_cv;
    bool released = false;
  };
  std::shared_ptr<ByteWatch> watch_byte(off_t offset);

  // Under the guard:
  std::ptrdiff_t find(std::uint64_t seq) const;
  void remove_at(std::size_t index);
  bool remove_if_dead(std::uint64_t seq);
  void sweep_dead();
  void recompute_mode();
  // Whether the state file is still the one at its path: a removed or replaced file means
  // the holds it records no longer exclude anyone.
  bool still_linked() const;

 private:
  void open_or_create(int root_fd);
  void create(int root_fd);
  void repair();

  std::string name_;
  std::string base_;
  int root_fd_ = -1;
  int fd_ = -1;
  Header* header_ = nullptr;
  int fifo_fds_[2] = {-1, -1};
  std::mutex pool_mutex_;
  std::vector<int> pool_;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  std::mutex watches_mutex_;
  std::unordered_map<off_t, std::weak_ptr<ByteWatch>> watches_;
};

NameFile::Guard::Guard(NameFile& file) : file_(file) {
  int rc = pthread_mutex_lock(&file_.header_->mutex);
  if (rc == EOWNERDEAD) {
    file_.repair();
    pthread_mutex_consistent(&file_.header_->mutex);
  } else if (rc != 0) {
    fail_io("state mutex of '" + file_.name_ + "'", rc);
  }
}

NameFile::NameFile(int root_fd, std::string name) : name_(std::move(name)), base_(encode_name(name_)), root_fd_(root_fd) {
  open_or_create(root_fd);
}

NameFile::~NameFile() {
  for (int fd : pool_) close(fd);
  for (int fd : fifo_fds_) {
    if (fd >= 0) close(fd);
  }
  if (header_) munmap(header_, sizeof(Header));
  if (fd_ >= 0) close(fd_);
}

void NameFile::open_or_create(int root_fd) {
  const std::string state = base_ + ".s";
  for (int attempt = 0; attempt < 100; ++attempt) {
    int fd = openat(root_fd, state.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
      if (errno == ENOENT) {
        create(root_fd);
        continue;
      }
      fail_io("cannot open the state of '" + name_ + "'");
    }
    struct stat st {};
    if (fstat(fd, &st) != 0) fail_io("stat");
    if (!S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
      close(fd);
      throw BackendUnavailable("refusing the state file of '" + name_ + "': not a regular file owned by this user");
    }
    if (static_cast<std::size_t>(st.st_size) != sizeof(Header)) {
      close(fd);
      throw BackendUnavailable("the state file of '" + name_ + "' has an unexpected size (another turnstile version?)");
    }
    void* map = mmap(nullptr, sizeof(Header), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
      int error = errno;
      close(fd);
      fail_io("mmap", error);
    }
    auto* header = static_cast<Header*>(map);
    if (header->magic != kMagic || header->version != kVersion) {
      munmap(map, sizeof(Header));
      close(fd);
      throw BackendUnavailable("the state file of '" + name_ + "' is not a turnstile v1 state file");
    }
    if (std::strncmp(header->boot_id, boot_id().c_str(), sizeof header->boot_id) != 0) {
      // Written before a reboot: its mutex may belong to a thread that no longer exists.
      // Replace it, once, under a lock on the root directory, keeping the fencing counter.
      if (flock(root_fd, LOCK_EX) == 0) {
        struct stat now {};
        if (fstatat(root_fd, state.c_str(), &now, AT_SYMLINK_NOFOLLOW) == 0 && now.st_ino == st.st_ino) {
          const auto carried = header->next_seq;
          munmap(map, sizeof(Header));
          close(fd);
          unlinkat(root_fd, state.c_str(), 0);
          create(root_fd);
          int fresh = openat(root_fd, state.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
          if (fresh >= 0) {
            if (void* m = mmap(nullptr, sizeof(Header), PROT_READ | PROT_WRITE, MAP_SHARED, fresh, 0); m != MAP_FAILED) {
              static_cast<Header*>(m)->next_seq = carried;
              munmap(m, sizeof(Header));
            }
            close(fresh);
          }
        } else {
          munmap(map, sizeof(Header));
          close(fd);
        }
        flock(root_fd, LOCK_UN);
        continue;
      }
      munmap(map, sizeof(Header));
      close(fd);
      fail_io("lock of the backend directory");
    }
    if (header->name_length != name_.size() || std::memcmp(header->name, name_.data(), name_.size()) != 0) {
      munmap(map, sizeof(Header));
      close(fd);
      throw BackendUnavailable("the state file for '" + name_ + "' belongs to another name (hash collision)");
    }
    fd_ = fd;
    header_ = header;
    dev_ = st.st_dev;
    ino_ = st.st_ino;
    return;
  }
  throw BackendUnavailable("cannot open the state of '" + name_ + "': it keeps changing");
}

// Builds the file aside and links it into place, so nobody ever sees it half-initialised.
void NameFile::create(int root_fd) {
  for (const char* suffix : {".wl", ".wc"}) {
    if (mkfifoat(root_fd, (base_ + suffix).c_str(), 0600) != 0 && errno != EEXIST) fail_io("mkfifo");
  }
  std::random_device random;
  const std::string temp = base_ + ".tmp." + std::to_string(getpid()) + "." + std::to_string(random());
  int fd = openat(root_fd, temp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) fail_io("cannot create the state of '" + name_ + "'");
  const auto cleanup = [&] {
    close(fd);
    unlinkat(root_fd, temp.c_str(), 0);
  };
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
  std::memset(header, 0, sizeof(Header));
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
  const bool linked = linkat(root_fd, temp.c_str(), root_fd, (base_ + ".s").c_str(), 0) == 0;
  const int error = errno;
  cleanup();
  if (!linked && error != EEXIST) fail_io("cannot publish the state of '" + name_ + "'", error);
}

void NameFile::repair() {
  // The previous owner died while changing the queue: drop duplicates and dead entries.
  auto& h = *header_;
  if (h.count > kCapacity) h.count = kCapacity;
  std::set<std::uint64_t> seen;
  for (std::size_t i = 0; i < h.count;) {
    if (!seen.insert(h.entries[i].seq).second) {
      remove_at(i);
    } else {
      ++i;
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
  int fd = open(self.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) fail_io("cannot reopen the state of '" + name_ + "'");
  return fd;
}

std::shared_ptr<NameFile::ByteWatch> NameFile::watch_byte(off_t offset) {
  std::lock_guard lock(watches_mutex_);
  std::erase_if(watches_, [](const auto& item) { return item.second.expired(); });
  if (auto existing = watches_[offset].lock()) return existing;
  auto watch = std::make_shared<ByteWatch>();
  const int fd = checkout_descriptor();
  std::thread([watch, fd, offset] {
    try {
      set_lock(fd, F_RDLCK, offset, 1, true);
      set_lock(fd, F_UNLCK, offset, 1, false);
    } catch (...) {
      // Reported as "released": the waiter looks at the queue again and decides.
    }
    close(fd);  // its own description: the NameFile may be gone by now
    std::lock_guard lock(watch->mutex);
    watch->released = true;
    watch->released_cv.notify_all();
  }).detach();
  watches_[offset] = watch;
  return watch;
}

void NameFile::return_descriptor(int fd) {
  std::lock_guard lock(pool_mutex_);
  pool_.push_back(fd);
}

int NameFile::fifo(bool counter) {
  std::lock_guard lock(pool_mutex_);
  int& fd = fifo_fds_[counter ? 1 : 0];
  if (fd < 0) {
    // Read-write, so the pipe exists (and keeps written bytes) while any process has it open.
    fd = openat(root_fd_, (base_ + (counter ? ".wc" : ".wl")).c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) fail_io("cannot open the wake-up FIFO of '" + name_ + "'");
  }
  return fd;
}

void NameFile::wake(bool counter) {
  const auto sleepers = counter ? header_->counter_sleepers : header_->lease_sleepers;
  if (sleepers == 0) return;
  const char byte = 1;
  // A full pipe already holds a pending wake-up: EAGAIN is fine.
  [[maybe_unused]] auto written = write(fifo(counter), &byte, 1);
}

void NameFile::drain(bool counter) {
  char buffer[64];
  const int fd = fifo(counter);
  while (read(fd, buffer, sizeof buffer) > 0) {
  }
}

std::ptrdiff_t NameFile::find(std::uint64_t seq) const {
  for (std::size_t i = 0; i < header_->count; ++i) {
    if (header_->entries[i].seq == seq) return static_cast<std::ptrdiff_t>(i);
  }
  return -1;
}

void NameFile::remove_at(std::size_t index) {
  auto& h = *header_;
  std::memmove(&h.entries[index], &h.entries[index + 1], (h.count - index - 1) * sizeof(Entry));
  --h.count;
}

bool NameFile::remove_if_dead(std::uint64_t seq) {
  const auto index = find(seq);
  if (index < 0 || is_locked(fd_, seq, Byte::life)) return false;
  remove_at(static_cast<std::size_t>(index));
  recompute_mode();
  wake(false);  // a dead lease holder frees its permits
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

bool NameFile::still_linked() const {
  struct stat mine {}, now {};
  if (fstat(fd_, &mine) != 0 || mine.st_nlink == 0) return false;
  if (fstatat(root_fd_, (base_ + ".s").c_str(), &now, AT_SYMLINK_NOFOLLOW) != 0) return false;
  return now.st_dev == dev_ && now.st_ino == ino_;
}

// Waits until nobody holds the byte (it was released or its owner died), or the deadline.
// F_OFD_SETLKW has no timeout, so a timed wait sleeps on a condition variable fed by a
// watcher thread blocked in F_OFD_SETLKW; the watcher outlives a timed-out waiter and ends
// by itself when the byte is released, and later waiters for the same byte share it.
bool wait_for_byte_release(NameFile& file, int fd, std::uint64_t seq, Byte which, Deadline deadline) {
  const off_t offset = byte_offset(seq, which);
  if (!deadline) {
    set_lock(fd, F_RDLCK, offset, 1, true);
    set_lock(fd, F_UNLCK, offset, 1, false);
    return true;
  }
  if (set_lock(fd, F_RDLCK, offset, 1, false)) {
    set_lock(fd, F_UNLCK, offset, 1, false);
    return true;
  }
  auto watch = file.watch_byte(offset);
  std::unique_lock lock(watch->mutex);
  watch->released_cv.wait_until(lock, *deadline, [&] { return watch->released; });
  return watch->released;
}

int timeout_ms(Deadline deadline) {
  if (!deadline) return -1;
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(*deadline - SteadyClock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, 24 * 3600 * 1000));
}

int open_pidfd(pid_t pid) { return static_cast<int>(syscall(SYS_pidfd_open, pid, 0)); }

// Opens the backend directory, creating missing parts private to this user; refuses a
// symbolic link, a non-directory, or a directory owned by someone else.
int open_root(const std::string& root) {
  for (std::size_t slash = 1; slash != std::string::npos;) {
    slash = root.find('/', slash + 1);
    const std::string prefix = root.substr(0, slash);
    if (mkdir(prefix.c_str(), 0700) != 0 && errno != EEXIST) fail_io("cannot create " + prefix);
  }
  int fd = open(root.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ELOOP || errno == ENOTDIR) {
      throw BackendUnavailable("refusing " + root + ": it is a symbolic link or not a directory");
    }
    fail_io("cannot open " + root);
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    int error = errno;
    close(fd);
    fail_io("stat " + root, error);
  }
  if (st.st_uid != geteuid()) {
    close(fd);
    throw BackendUnavailable("refusing " + root + ": it is owned by uid " + std::to_string(st.st_uid) +
                             ", not by this user (uid " + std::to_string(geteuid()) + ")");
  }
  return fd;
}

// Whether a file or directory we hold open was removed from the tree.
bool unlinked(int fd) {
  struct stat st {};
  return fstat(fd, &st) != 0 || st.st_nlink == 0;
}

class FileHold;

class FileBackend final : public Backend {
 public:
  FileBackend(std::string root, int root_fd) : root_(std::move(root)), root_fd_(root_fd) {}
  ~FileBackend() override {
    {
      // No join: waiting for the watcher to be scheduled just to see the stop costs a short
      // process (turnstile run) milliseconds on a busy machine. It exits on its own when it
      // next wakes, touching only the shared state; a check in progress uses our directory
      // descriptor, so that one we let finish.
      std::unique_lock lock(watch_->mutex);
      watch_->stop = true;
      watch_->cv.notify_all();
      // (Unless we are that check: a loss callback that dropped the last Client.)
      if (watch_->thread != std::this_thread::get_id()) watch_->cv.wait(lock, [&] { return !watch_->checking; });
    }
    files_.clear();
    close(root_fd_);
    for (int fd : removed_root_fds_) close(fd);
  }

  std::unique_ptr<BackendHold> acquire(const QueueRequest& request, Deadline deadline,
                                       std::shared_ptr<LossSignal> loss) override;
  Inspection inspect(const std::string& name) override;
  bool counter_try_set(const std::string& name, std::int64_t permits) override;
  std::int64_t counter_add(const std::string& name, std::int64_t delta) override;
  std::optional<std::int64_t> counter_get(const std::string& name) override;
  std::int64_t counter_drain(const std::string& name) override;
  bool counter_acquire(const std::string& name, std::int64_t permits, Deadline deadline) override;

  void watch(FileHold* hold);
  void unwatch(FileHold* hold);

 private:
  std::shared_ptr<NameFile> file(const std::string& name);
  struct WatchState;
  static void watch_loop(const std::shared_ptr<WatchState>& state);

  std::string root_;
  int root_fd_;
  std::vector<int> removed_root_fds_;  // still named by NameFiles that outlive their directory
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
  };
  std::shared_ptr<WatchState> watch_ = std::make_shared<WatchState>();
};

class FileHold final : public BackendHold {
 public:
  FileHold(FileBackend& backend, std::shared_ptr<NameFile> file, int fd, std::uint64_t seq, EntryKind kind,
           std::shared_ptr<LossSignal> loss)
      : backend_(backend), file_(std::move(file)), fd_(fd), seq_(seq), kind_(kind), loss_(std::move(loss)) {
    backend_.watch(this);
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
    NameFile::Guard guard(*file_);
    if (auto index = file_->find(seq_); index >= 0) {
      file_->header().entries[index].kind = static_cast<std::uint8_t>(EntryKind::shared);
    }
    kind_ = EntryKind::shared;
    set_lock(fd_, F_UNLCK, byte_offset(seq_, Byte::exclusive), 1, false);  // readers behind wake
  }

  void release() override {
    if (fd_ < 0) return;
    backend_.unwatch(this);
    bool found;
    {
      NameFile::Guard guard(*file_);
      const auto index = file_->find(seq_);
      found = index >= 0;
      if (found) file_->remove_at(static_cast<std::size_t>(index));
      file_->recompute_mode();
      // This description holds only this entry's bytes: unlocking the whole file drops the
      // same locks, and the kernel skips allocating the two lock records that splitting a
      // range may need (a ranged unlock allocates them on every call).
      set_lock(fd_, F_UNLCK, 0, 0, false);
      if (kind_ == EntryKind::lease) file_->wake(false);
    }
    file_->return_descriptor(fd_);
    fd_ = -1;
    if (!found) loss_->lose("its entry vanished from the state file");
  }

  const std::shared_ptr<NameFile>& file() const { return file_; }
  const std::shared_ptr<LossSignal>& loss() const { return loss_; }

 private:
  friend class FileBackend;
  FileHold* watch_prev_ = nullptr;  // FileBackend::WatchState::holds, under its mutex
  FileHold* watch_next_ = nullptr;
  FileBackend& backend_;
  std::shared_ptr<NameFile> file_;
  int fd_;
  std::uint64_t seq_;
  EntryKind kind_;
  std::shared_ptr<LossSignal> loss_;
};

std::shared_ptr<NameFile> FileBackend::file(const std::string& name) {
  std::lock_guard lock(files_mutex_);
  auto& slot = files_[name];
  // A state file removed under us (rm -rf, a tmp cleaner) no longer excludes anyone: use the
  // one now at the path, never the orphan. Holds on the orphan keep it alive and are told by
  // the watcher that they may be lost.
  if (slot && unlinked(slot->probe_fd())) {
    slot.reset();
    if (unlinked(root_fd_)) {
      const int fresh = open_root(root_);
      removed_root_fds_.push_back(root_fd_);
      root_fd_ = fresh;
    }
  }
  if (!slot) slot = std::make_shared<NameFile>(root_fd_, name);
  return slot;
}

void FileBackend::watch(FileHold* hold) {
  std::lock_guard lock(watch_->mutex);
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
// state file removed or replaced under us (rm -rf, a tmp cleaner) no longer excludes anyone.
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
      if (!loss->lost() && !file->still_linked()) {
        loss->lose("the state file of '" + file->name() + "' was removed or replaced");
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
  auto name_file = file(request.name);
  NameFile& nf = *name_file;
  const int fd = nf.checkout_descriptor();
  std::uint64_t seq = 0;
  try {
    {
      NameFile::Guard guard(nf);
      auto& h = nf.header();
      const auto mode_text = [&] {
        return h.mode == Mode::lock ? std::string("lock") : h.mode == Mode::semaphore ? std::string("semaphore") : std::string();
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
      seq = h.next_seq + 1;
      Entry entry{seq, request.permits, realtime_ns(), my_pid(), static_cast<std::uint8_t>(request.kind), {}};
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
      if (!admitted && deadline && *deadline <= SteadyClock::now()) {
        // Try-once: nobody will wake us, so check that those ahead are alive before failing.
        nf.sweep_dead();
        admitted = admitted_at_tail();
        if (!admitted) {
          nf.return_descriptor(fd);
          return nullptr;  // nothing joined, nothing to undo
        }
      }
      // life, then exclusive for writers, then waiting for leases still in line
      const off_t length = request.kind == EntryKind::lease ? (admitted ? 1 : 3) : request.kind == EntryKind::exclusive ? 2 : 1;
      if (request.kind == EntryKind::lease && !admitted) {
        set_lock(fd, F_WRLCK, byte_offset(seq, Byte::life), 1, false);
        set_lock(fd, F_WRLCK, byte_offset(seq, Byte::waiting), 1, false);
      } else {
        set_lock(fd, F_WRLCK, byte_offset(seq, Byte::life), length, false);
      }
      h.entries[h.count] = entry;
      h.next_seq = seq;  // only after the entry is written: a crash leaves no half entry
      ++h.count;
      if (h.mode == Mode::none) {
        h.mode = request.kind == EntryKind::lease ? Mode::semaphore : Mode::lock;
        h.limit = request.kind == EntryKind::lease ? request.limit : 0;
      }
      if (admitted) return std::make_unique<FileHold>(*this, name_file, fd, seq, request.kind, loss);
    }
    // Wait in line: sleep on whatever can change our verdict, then look again.
    for (;;) {
      Verdict verdict;
      std::uint64_t target = 0;
      std::vector<pid_t> holder_pids;
      {
        NameFile::Guard guard(nf);
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
        verdict = evaluate_queue(views, mine, request.limit);
        if (verdict.admitted()) {
          if (request.kind == EntryKind::lease) set_lock(fd, F_UNLCK, byte_offset(seq, Byte::waiting), 1, false);
          return std::make_unique<FileHold>(*this, name_file, fd, seq, request.kind, loss);
        }
        if (deadline && *deadline <= SteadyClock::now()) {
          const auto index = nf.find(seq);
          if (index >= 0) nf.remove_at(static_cast<std::size_t>(index));
          nf.recompute_mode();
          set_lock(fd, F_UNLCK, byte_offset(seq, Byte::life), 4, false);
          nf.return_descriptor(fd);
          return nullptr;
        }
        if (verdict.wait == WaitFor::any_holder_leave) {
          // Dead holders ahead would never write to the FIFO: sweep them, then look again.
          bool swept = false;
          for (std::size_t i = 0; i < mine; ++i) swept |= nf.remove_if_dead(seqs[i]);
          if (swept) continue;
          // A lease ahead that the queue now admits may not know it yet: it sleeps on the FIFO
          // for the byte that admitted it, and draining the FIFO here would steal that wake-up.
          // Wait for it to notice (it drops its waiting byte) first, so that at most one
          // contender ever sleeps on the FIFO.
          for (std::size_t i = mine; i-- > 0;) {
            if (is_locked(nf.probe_fd(), seqs[i], Byte::waiting)) {
              verdict = {WaitFor::admission, i};
              break;
            }
          }
        }
        if (verdict.wait == WaitFor::any_holder_leave) {
          nf.drain(false);
          ++h.lease_sleepers;
          // Our own process cannot die without us; other holders wake us by dying, via pidfd.
          for (std::size_t i = 0; i < h.count && h.entries[i].seq != seq; ++i) {
            const auto& e = h.entries[i];
            if (e.kind != kCounterWaiter && e.pid != my_pid()) holder_pids.push_back(e.pid);
          }
          std::sort(holder_pids.begin(), holder_pids.end());
          holder_pids.erase(std::unique(holder_pids.begin(), holder_pids.end()), holder_pids.end());
        } else {
          target = seqs[verdict.index];
        }
      }
      if (verdict.wait == WaitFor::any_holder_leave) {
        std::vector<pollfd> fds{{nf.fifo(false), POLLIN, 0}};
        bool gone = false;
        for (pid_t pid : holder_pids) {
          const int pidfd = open_pidfd(pid);
          if (pidfd >= 0) {
            fds.push_back({pidfd, POLLIN, 0});
          } else {
            gone |= errno == ESRCH;  // it died since we looked: look again at once
          }
        }
        if (!gone) {
          while (poll(fds.data(), fds.size(), timeout_ms(deadline)) < 0 && errno == EINTR) {
          }
        }
        for (std::size_t i = 1; i < fds.size(); ++i) {
          if (fds[i].fd >= 0) close(fds[i].fd);
        }
        NameFile::Guard guard(nf);
        --nf.header().lease_sleepers;
        continue;
      }
      const Byte which = verdict.wait == WaitFor::leave ? Byte::life
                         : verdict.wait == WaitFor::exclusive_end ? Byte::exclusive
                                                                  : Byte::waiting;
      if (wait_for_byte_release(nf, fd, target, which, deadline)) {
        NameFile::Guard guard(nf);
        nf.remove_if_dead(target);  // released by death rather than by leaving
      }
    }
  } catch (...) {
    if (seq != 0) {
      try {
        NameFile::Guard guard(nf);
        const auto index = nf.find(seq);
        if (index >= 0) nf.remove_at(static_cast<std::size_t>(index));
        nf.recompute_mode();
        set_lock(fd, F_UNLCK, byte_offset(seq, Byte::life), 4, false);
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
  return result;
}

bool FileBackend::counter_try_set(const std::string& name, std::int64_t permits) {
  auto nf = file(name);
  NameFile::Guard guard(*nf);
  auto& h = nf->header();
  if (h.counter_set) return false;
  h.counter = permits;
  h.counter_set = 1;
  nf->wake(true);
  return true;
}

std::int64_t FileBackend::counter_add(const std::string& name, std::int64_t delta) {
  auto nf = file(name);
  NameFile::Guard guard(*nf);
  auto& h = nf->header();
  const std::int64_t current = h.counter_set ? h.counter : 0;
  std::int64_t updated;
  if (__builtin_add_overflow(current, delta, &updated)) {
    throw InvalidArgument("PermitCounter '" + name + "': adding " + std::to_string(delta) + " would overflow");
  }
  h.counter = updated;
  h.counter_set = 1;
  if (delta > 0) nf->wake(true);
  return updated;
}

std::optional<std::int64_t> FileBackend::counter_get(const std::string& name) {
  auto nf = file(name);
  NameFile::Guard guard(*nf);
  auto& h = nf->header();
  if (!h.counter_set) return std::nullopt;
  return h.counter;
}

std::int64_t FileBackend::counter_drain(const std::string& name) {
  auto nf = file(name);
  NameFile::Guard guard(*nf);
  auto& h = nf->header();
  if (!h.counter_set) return 0;
  const auto drained = h.counter;
  h.counter = 0;
  return drained;
}

// Counter waiters queue in arrival order: the first sleeps on the counter FIFO until permits
// are added, the others on their predecessor's life byte.
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
      {
        NameFile::Guard guard(nf);
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
          return true;
        }
        if (deadline && *deadline <= SteadyClock::now()) {
          if (seq == 0 && !first) {
            nf.sweep_dead();  // a dead waiter ahead would make try_acquire fail forever
            if (nf.header().counter_set && nf.header().counter >= permits &&
                std::none_of(h.entries, h.entries + h.count, [](const Entry& e) { return e.kind == kCounterWaiter; })) {
              h.counter -= permits;
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
          seq = h.next_seq + 1;
          set_lock(fd, F_WRLCK, byte_offset(seq, Byte::life), 1, false);
          h.entries[h.count] = Entry{seq, permits, realtime_ns(), my_pid(), kCounterWaiter, {}};
          h.next_seq = seq;
          ++h.count;
          continue;  // look again as a member of the queue
        }
        if (first) {
          nf.drain(true);
          ++h.counter_sleepers;
        }
      }
      if (predecessor == 0) {
        pollfd pfd{nf.fifo(true), POLLIN, 0};
        while (poll(&pfd, 1, timeout_ms(deadline)) < 0 && errno == EINTR) {
        }
        NameFile::Guard guard(nf);
        --nf.header().counter_sleepers;
      } else if (wait_for_byte_release(nf, fd, predecessor, Byte::life, deadline)) {
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
  const int fd = open_root(root);
  return std::make_unique<FileBackend>(root, fd);
}

}  // namespace turnstile::detail
