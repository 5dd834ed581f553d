// SPDX-License-Identifier: Apache-2.0
#include "backends/file/state_file.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <random>

#include "backends/file/directory.hpp"
#include "core/text_escape.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail::file_state {
namespace {

// Opening a state file that keeps being replaced or truncated under us gives up after this many
// rounds (each round is a few system calls; a real fight ends in far fewer).
constexpr int kOpenAttempts = 100;
// Encoded names longer than this use a hash prefix (file names stay well below NAME_MAX).
constexpr std::size_t kLongestEncodedName = 200;

__attribute__((tls_model("initial-exec"))) thread_local MappingAccess* current_access = nullptr;
struct sigaction previous_sigbus {};

// File names: ASCII letters, digits and "-_." kept, every other byte (including '/' and every
// byte >= 0x80) percent-encoded, so no name can traverse or collide. A pure function of the
// bytes: never std::isalnum, which follows the C locale (a Latin-1 locale would keep 0xE9).
// Long names fall back to a hash checked against the stored name.
bool kept_as_is(unsigned char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.';
}

std::string encode_name(const std::string& name) {
  const auto out = percent_encode(name, kept_as_is);
  if (out.size() <= kLongestEncodedName) return "n." + out;
  return "h." + hex_number(fnv1a(name), 16, HexCase::upper) + "." + out.substr(0, 180);
}

bool same_boot(const char (&id)[40]) { return std::strncmp(id, boot_id().c_str(), sizeof id) == 0; }
bool same_boot(const Header& h) { return same_boot(h.boot_id); }

[[noreturn]] void refuse_foreign_file(const std::string& name) {
  throw AccessDenied("refusing the state file of '" + name +
                     "': not a regular file owned by this user (or, in a directory a group shares, by the group)");
}

}  // namespace

// ---- the mapping ---------------------------------------------------------------------------

Mapping::Mapping(int fd) {
  // Address room only (no memory, no commit charge): the file's pages are mapped into it.
  void* room = mmap(nullptr, kReserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (room == MAP_FAILED) fail_io("mmap");
  header_ = static_cast<Header*>(room);
  if (!extend(fd, kFirstCapacity)) {
    munmap(room, kReserved);
    header_ = nullptr;
    fail_io("mmap");
  }
}

Mapping::~Mapping() {
  if (header_) munmap(header_, kReserved);
}

Mapping& Mapping::operator=(Mapping&& other) noexcept {
  if (this != &other) {
    if (header_) munmap(header_, kReserved);
    header_ = std::exchange(other.header_, nullptr);
    capacity_.store(other.capacity_.exchange(0), std::memory_order_release);
  }
  return *this;
}

// Only the pages not mapped yet are mapped (both ends are page boundaries): a thread reading the
// header or mapped slots meanwhile never finds them gone.
bool Mapping::extend(int fd, std::size_t capacity) noexcept {
  const std::size_t mapped = capacity_.load(std::memory_order_relaxed);
  const std::size_t from = mapped == 0 ? 0 : file_size(mapped);
  const std::size_t to = file_size(capacity);
  void* map = mmap(reinterpret_cast<char*>(header_) + from, to - from, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                   fd, static_cast<off_t>(from));
  if (map == MAP_FAILED) return false;
  capacity_.store(capacity, std::memory_order_release);
  return true;
}

MappingAccess::MappingAccess(void* base, std::size_t size, std::atomic<bool>& broken)
    : base_(static_cast<char*>(base)), size_(size), broken_(&broken), previous_(current_access) {
  current_access = this;
  std::atomic_signal_fence(std::memory_order_seq_cst);
}

MappingAccess::~MappingAccess() {
  std::atomic_signal_fence(std::memory_order_seq_cst);
  current_access = previous_;
}

void MappingAccess::on_sigbus(int signal, siginfo_t* info, void* context) {
  for (auto* access = current_access; access; access = access->previous_) {
    auto* address = static_cast<char*>(info->si_addr);
    if (info->si_code > 0 && address >= access->base_ && address < access->base_ + access->size_) {
      if (mmap(access->base_, access->size_, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) !=
          MAP_FAILED) {
        access->broken_->store(true, std::memory_order_relaxed);
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

void MappingAccess::install_sigbus_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action {};
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    sigaction(SIGBUS, &action, &previous_sigbus);
  });
}

// ---- the robust mutex ----------------------------------------------------------------------

StateFile::Guard::Guard(StateFile& file) : file_(file), access_(file.map_.get(), Mapping::kReserved, file.broken_) {
  after_lock(pthread_mutex_lock(&file_.header().mutex));
}

StateFile::Guard::Guard(StateFile& file, std::try_to_lock_t)
    : file_(file), access_(file.map_.get(), Mapping::kReserved, file.broken_) {
  const int rc = pthread_mutex_trylock(&file_.header().mutex);
  owns_ = rc != EBUSY;
  if (owns_) after_lock(rc);
}

void StateFile::Guard::after_lock(int rc) {
  if (rc == EOWNERDEAD) {
    file_.fit_mapping();  // a process that grew the file may have died right after
    file_.repair();
    pthread_mutex_consistent(&file_.header().mutex);
  } else if (rc != 0) {
    fail_io("state mutex of '" + file_.name_ + "'", rc);
  }
  if (file_.header().magic != kMagic) file_.broken_.store(true, std::memory_order_relaxed);  // zeroed
  file_.fit_mapping();  // one compare, unless another process grew the file
}

StateFile::Guard::~Guard() {
  if (!owns_) return;
  if (file_.local_.has_woken()) {
    unlock_telling_woken();
  } else {
    pthread_mutex_unlock(&file_.header().mutex);
  }
}

// Our entries dropped bytes under the guard: their armed waiters wake once the mutex is free, so
// that their looks do not sleep on it once more. Out of line: the uncontended path skips it.
void StateFile::Guard::unlock_telling_woken() noexcept {
  const auto woken = file_.local_.take_woken();
  pthread_mutex_unlock(&file_.header().mutex);
  tell_released(woken);
}

void StateFile::check_intact() const {
  if (broken()) {
    throw BackendUnavailable("the state file of '" + name_ + "' was truncated or overwritten while in use");
  }
}

// ---- opening, creating, replacing ----------------------------------------------------------

bool StateFile::exists(int root_fd, const std::string& name) {
  struct stat st {};
  return fstatat(root_fd, (encode_name(name) + ".s").c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
}

std::string StateFile::base_of(const std::string& name) { return encode_name(name); }

StateFile::StateFile(int root_fd, std::shared_ptr<DirectoryPins> pins, std::string name)
    : name_(std::move(name)), base_(encode_name(name_)), state_name_(base_ + ".s"), root_fd_(root_fd),
      pins_(std::move(pins)), pin_byte_(DirectoryPins::byte_of(name_)) {
  MappingAccess::install_sigbus_handler();
  open_or_create();
}

StateFile::~StateFile() { release_pin_locked(); }  // nobody else refers to us any more

bool StateFile::made_by_the_group(const struct stat& file) const {
  struct stat dir {};
  return fstat(root_fd_, &dir) == 0 && shared_by_group(dir) && file.st_gid == dir.st_gid && !(file.st_mode & S_IWOTH);
}

void StateFile::open_or_create() {
  for (int attempt = 0; attempt < kOpenAttempts; ++attempt) {
    Fd fd(openat(root_fd_, state_name_.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC));
    if (!fd) {
      if (errno == ENOENT) {
        create();
        continue;
      }
      if (errno == ELOOP || errno == EISDIR || errno == ENXIO)
        refuse_foreign_file(name_);  // a link, a directory, a socket
      fail_io("cannot open the state of '" + name_ + "'");
    }
    struct stat st {};
    if (fstat(fd.get(), &st) != 0) fail_io("stat");
    if (!S_ISREG(st.st_mode) || (st.st_uid != geteuid() && !made_by_the_group(st))) refuse_foreign_file(name_);
    if (!looks_current(fd, st)) {
      replace_truncated(fd, st);
      continue;
    }
    Mapping map(fd.get());
    std::uint64_t carried = 0;
    const Found found = examine(fd, map, carried);
    if (found == Found::torn) continue;  // truncated while we looked: look again
    if (found == Found::cut) {
      replace_cut(fd, st, carried);
      continue;
    }
    if (found == Found::earlier_boot) {
      // Written before a reboot: its mutex may belong to a thread that no longer exists.
      replace(st.st_ino, carried);
      continue;
    }
    if (found != Found::ok) refuse(found);
    fd_ = std::move(fd);
    map_ = std::move(map);
    dev_ = st.st_dev;
    ino_ = st.st_ino;
    return;
  }
  throw BackendUnavailable("cannot open the state of '" + name_ + "': it keeps changing");
}

bool StateFile::looks_current(const Fd& fd, const struct stat& st) {
  std::uint32_t magic = 0;
  return st.st_size >= static_cast<off_t>(file_size(kFirstCapacity)) &&
         pread(fd.get(), &magic, sizeof magic, 0) == sizeof magic && magic == kMagic;
}

StateFile::Found StateFile::examine(const Fd& fd, const Mapping& map, std::uint64_t& carried) const {
  std::atomic<bool> torn{false};
  Found found;
  {
    MappingAccess access(map.get(), Mapping::kReserved, torn);
    const Header& h = *map.get();
    carried = h.next_seq;
    const std::size_t capacity = std::atomic_ref<const std::uint32_t>(h.capacity).load(std::memory_order_acquire);
    struct stat now {};
    if (h.magic != kMagic || h.version != kVersion) {
      found = Found::foreign;
    } else if (!same_boot(h)) {
      found = Found::earlier_boot;
    } else if (h.name_length != name_.size() || std::memcmp(h.name, name_.data(), name_.size()) != 0) {
      found = Found::other_name;
    } else if (capacity < kFirstCapacity || capacity > kMaxCapacity || capacity % kFirstCapacity != 0) {
      found = Found::foreign;  // no capacity turnstile writes
    } else {
      // Sized after the capacity was read: a file grows before its capacity says so (grow()).
      found =
          fstat(fd.get(), &now) == 0 && now.st_size >= static_cast<off_t>(file_size(capacity)) ? Found::ok : Found::cut;
    }
  }
  return torn.load() ? Found::torn : found;
}

void StateFile::refuse(Found found) const {
  switch (found) {
    case Found::foreign:
      throw BackendUnavailable("the state file of '" + name_ + "' is not a turnstile v" + std::to_string(kVersion) +
                               " state file (another turnstile version?)");
    case Found::older_version:
      // Written in this boot by an earlier version (whose layout differs): a process of that
      // version may join it at any moment, so never take it over (after a reboot we do).
      throw BackendUnavailable("the state file of '" + name_ + "' belongs to an older turnstile version; remove " +
                               state_name_ + " once no process of that version uses it");
    case Found::other_name:
      throw BackendUnavailable("the state file for '" + name_ + "' belongs to another name (hash collision)");
    default: break;
  }
}

// A state file that does not start as one of this version, or is too short to map: an older
// version's (whose magic was kOldMagic), ours truncated (its queue is gone), or something else,
// refused.
void StateFile::replace_truncated(const Fd& fd, const struct stat& st) {
  struct {
    std::uint32_t magic, version;
    char boot_id[40];
  } start{};
  std::uint64_t next_seq = 0;
  const bool whole_start =
      pread(fd.get(), &start, sizeof start, 0) == static_cast<ssize_t>(sizeof start) &&
      pread(fd.get(), &next_seq, sizeof next_seq, offsetof(Header, next_seq)) == static_cast<ssize_t>(sizeof next_seq);
  // Versions 1 to 5 start as ours does (state.hpp). Written in this boot, processes of that
  // version may use it (and a PermitCounter's count lives in it unlocked): never taken over.
  // From an earlier boot: replaced, keeping the fencing counter.
  if (whole_start && start.magic == kOldMagic && start.version >= 1 && start.version < kVersion) {
    if (same_boot(start.boot_id)) refuse(Found::older_version);
    replace(st.st_ino, next_seq);
    return;
  }
  // Too short to say whose it is, or one of this version cut short: ours.
  const bool ours = st.st_size < 8 || (start.magic == kMagic && start.version == kVersion);
  if (!ours) refuse(Found::foreign);
  replace_cut(fd, st, whole_start ? next_seq : 0);
}

// Ours cut short (truncated by hand or a cleaner): replaced once no entry still alive holds its
// bytes (each holder is told by its own check), keeping the fencing counter when it is readable.
void StateFile::replace_cut(const Fd& fd, const struct stat& st, std::uint64_t carried) {
  if (is_locked(fd.get(), kByteBase, 0)) {
    throw StateFileInUse("the state file of '" + name_ +
                         "' was truncated and is still used by a live "
                         "process (which is told its hold is lost); try again once it has let go");
  }
  replace(st.st_ino, carried);
}

// Replaces the state file whose inode is `ino` by a fresh one carrying the fencing counter, once
// (other processes may be doing the same), under a lock on the root directory.
void StateFile::replace(ino_t ino, std::uint64_t carried_seq) {
  if (flock(root_fd_, LOCK_EX) != 0) fail_io("lock of the backend directory");
  struct Unlock {
    int fd;
    ~Unlock() { flock(fd, LOCK_UN); }
  } unlock{root_fd_};
  struct stat now {};
  if (fstatat(root_fd_, state_name_.c_str(), &now, AT_SYMLINK_NOFOLLOW) != 0 || now.st_ino != ino) return;
  unlinkat(root_fd_, state_name_.c_str(), 0);
  create();
  Fd fresh(openat(root_fd_, state_name_.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC));
  if (fresh) Mapping(fresh.get())->next_seq = carried_seq;
}

void StateFile::initialise(Header& header) const {
  header.magic = kMagic;
  header.version = kVersion;
  std::strncpy(header.boot_id, boot_id().c_str(), sizeof header.boot_id - 1);
  pthread_mutexattr_t attributes;
  pthread_mutexattr_init(&attributes);
  pthread_mutexattr_setpshared(&attributes, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attributes, PTHREAD_MUTEX_ROBUST);
  pthread_mutex_init(&header.mutex, &attributes);
  pthread_mutexattr_destroy(&attributes);
  header.capacity = kFirstCapacity;
  header.name_length = static_cast<std::uint32_t>(name_.size());
  std::memcpy(header.name, name_.data(), name_.size());
}

// Builds the file aside and links it into place, so nobody ever sees it half-initialised.
void StateFile::create() {
  std::random_device random;
  const std::string temp = base_ + ".tmp." + std::to_string(getpid()) + "." + std::to_string(random());
  Fd fd(openat(root_fd_, temp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd) fail_io("cannot create the state of '" + name_ + "'");
  // In a directory a group shares, the group's other users open it too, whatever our umask.
  if (shared_by_group(root_fd_) && fchmod(fd.get(), 0660) != 0) fail_io("cannot share the state of '" + name_ + "'");
  struct RemoveTemp {
    int root_fd;
    const std::string& temp;
    ~RemoveTemp() { unlinkat(root_fd, temp.c_str(), 0); }
  } remove_temp{root_fd_, temp};
  // ftruncate fills with zeros without writing them: only the pages we touch use space, and
  // those are backed first (the header now; labels and slots as they are reached).
  if (ftruncate(fd.get(), static_cast<off_t>(file_size(kFirstCapacity))) != 0) fail_io("ftruncate");
  back_with_storage(fd.get(), 0, offsetof(Header, labels), name_);
  initialise(*Mapping(fd.get()).get());
  if (pins_->pinned(pin_byte_)) {
    struct stat now {};
    if (fstatat(root_fd_, state_name_.c_str(), &now, AT_SYMLINK_NOFOLLOW) == 0) return;  // made meanwhile: open it
    // The name's file was removed or moved away while a process holds something of it (or one
    // admitted in a file removed as unused pins the name for the moment it takes to notice).
    throw StateFileInUse("the state file of '" + name_ + "' was removed while a live process still holds '" + name_ +
                         "' (it is told its hold is lost); try again once it has let go");
  }
  if (linkat(root_fd_, temp.c_str(), root_fd_, state_name_.c_str(), 0) != 0 && errno != EEXIST) {
    fail_io("cannot publish the state of '" + name_ + "'");
  }
}

// The epoch is changed atomically everywhere: a stop callback rings without the mutex.
std::uint32_t StateFile::counter_epoch() {
  return std::atomic_ref<std::uint32_t>(header().counter_epoch).load(std::memory_order_relaxed);
}

void StateFile::ring_counter() {
  std::atomic_ref<std::uint32_t>(header().counter_epoch).fetch_add(1, std::memory_order_relaxed);
  if (header().counter_sleepers != 0) futex_wake_all(&header().counter_epoch);
}

void StateFile::wake_counter_waiters() {
  MappingAccess access(map_.get(), Mapping::kReserved, broken_);
  std::atomic_ref<std::uint32_t>(header().counter_epoch).fetch_add(1, std::memory_order_relaxed);
  futex_wake_all(&header().counter_epoch);
}

bool StateFile::remove_if_unused() {
  if (generation_ != current_generation() || broken()) return false;  // a parent's file: not ours
  stop_keeping_pin();  // closing it: our own pin must not keep it (nobody here holds it)
  // Busy means in use: skipped, and never a wait on a process paused inside the mutex (closing
  // one name must not stall a client's other names).
  Guard guard(*this, std::try_to_lock);
  if (!guard.owns() || broken()) return false;
  sweep_dead();
  const auto& h = header();
  // A PermitCounter's value lives only here; a pin means a holder (of this file, or of one
  // removed by hand whose name it keeps from being made afresh).
  if (h.removed || h.count != 0 || h.counter_set != 0 || pins_->pinned(pin_byte_)) return false;
  // At its path, it is linked and whole (the path's inode is this file's).
  if (!at_its_path()) return false;
  if (unlinkat(root_fd_, state_name_.c_str(), 0) != 0) return false;
  // Before the mutex is let go: whoever takes it next and opened this file before sees the mark
  // and adds nothing to it (removed_as_unused).
  std::atomic_ref<std::uint32_t>(header().removed).store(1, std::memory_order_release);
  return true;
}

bool StateFile::removed_as_unused() {
  MappingAccess access(map_.get(), Mapping::kReserved, broken_);
  return std::atomic_ref<std::uint32_t>(header().removed).load(std::memory_order_acquire) != 0;
}

bool StateFile::still_valid() {
  // At its path, it is linked and whole (the path's inode is this file's): no fstat of our own.
  if (broken() || !at_its_path()) return false;
  MappingAccess access(map_.get(), Mapping::kReserved, broken_);
  return header().magic == kMagic && !broken();
}

}  // namespace turnstile::detail::file_state
