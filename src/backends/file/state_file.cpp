#include "backends/file/state_file.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <unistd.h>

#include <bitset>
#include <cstddef>
#include <cstring>
#include <random>
#include <set>

#include "backends/file/directory.hpp"
#include "core/text_escape.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail::file_state {
namespace {

// Opening a state file that keeps being replaced or truncated under us gives up after this many
// rounds (each round is a few system calls; a real fight ends in far fewer).
constexpr int kOpenAttempts = 100;
// A name keeps at most this many spare descriptions (each contender needs one of its own).
constexpr std::size_t kSpareDescriptors = 2;
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

constexpr std::size_t kPage = 4096;

// Backs [offset, offset + length) of the state file with storage before anything is written
// there. The file is sparse: a page is otherwise allocated when first touched, and on a full
// file system (a 5 MB /run/lock) that touch is a SIGBUS, possibly with the mutex held. Asked
// only when a write reaches a page not written before; refused with a clear error instead.
void back_with_storage(int fd, std::size_t offset, std::size_t length, const std::string& name) {
  const auto first = offset / kPage * kPage;
  const auto last = (offset + length + kPage - 1) / kPage * kPage;
  int error;
  do {
    error = fallocate(fd, 0, static_cast<off_t>(first), static_cast<off_t>(last - first)) == 0 ? 0 : errno;
  } while (error == EINTR);
  if (error == EOPNOTSUPP) return;  // a file system without it: pages are allocated as touched
  if (error != 0) fail_io("no room for the state of '" + name + "'", error);
}

[[noreturn]] void refuse_foreign_file(const std::string& name) {
  throw AccessDenied("refusing the state file of '" + name +
                     "': not a regular file owned by this user (or, in a directory a group shares, by the group)");
}

}  // namespace

// ---- the mapping ---------------------------------------------------------------------------

Mapping::Mapping(int fd) {
  void* map = mmap(nullptr, sizeof(Header), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) fail_io("mmap");
  header_ = static_cast<Header*>(map);
}

Mapping::~Mapping() {
  if (header_) munmap(header_, sizeof(Header));
}

Mapping& Mapping::operator=(Mapping&& other) noexcept {
  if (this != &other) {
    if (header_) munmap(header_, sizeof(Header));
    header_ = std::exchange(other.header_, nullptr);
  }
  return *this;
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

StateFile::Guard::Guard(StateFile& file) : file_(file), access_(file.map_.get(), sizeof(Header), file.broken_) {
  const int rc = pthread_mutex_lock(&file_.header().mutex);
  if (rc == EOWNERDEAD) {
    file_.repair();
    pthread_mutex_consistent(&file_.header().mutex);
  } else if (rc != 0) {
    fail_io("state mutex of '" + file_.name_ + "'", rc);
  }
  if (file_.header().magic != kMagic) file_.broken_.store(true, std::memory_order_relaxed);  // zeroed
}

StateFile::Guard::~Guard() { pthread_mutex_unlock(&file_.header().mutex); }

void StateFile::check_intact() const {
  if (broken()) {
    throw BackendUnavailable("the state file of '" + name_ + "' was truncated or overwritten while in use");
  }
}

void StateFile::repair() {
  // The previous owner died while changing the queue. A slot is complete when its seq is not 0
  // (remove_at writes seq last); a seq seen twice is a slot caught mid-move, whose later copy
  // is the one never overwritten (moves go towards the front). Then drop dead entries.
  auto& h = header();
  if (h.count > kCapacity) h.count = kCapacity;
  std::set<std::uint64_t> seen;
  for (std::size_t i = h.count; i-- > 0;) {
    if (h.slots[i].seq == 0 || h.slots[i].seq > h.next_seq || !seen.insert(h.slots[i].seq).second) remove_at(i);
  }
  sweep_dead();
}

// ---- opening, creating, replacing ----------------------------------------------------------

bool StateFile::exists(int root_fd, const std::string& name) {
  struct stat st {};
  return fstatat(root_fd, (encode_name(name) + ".s").c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
}

StateFile::StateFile(int root_fd, std::shared_ptr<DirectoryPins> pins, std::string name)
    : name_(std::move(name)), base_(encode_name(name_)), state_name_(base_ + ".s"), root_fd_(root_fd),
      pins_(std::move(pins)), pin_byte_(DirectoryPins::byte_of(name_)) {
  MappingAccess::install_sigbus_handler();
  open_or_create();
}

StateFile::~StateFile() = default;

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
    if (static_cast<std::size_t>(st.st_size) != sizeof(Header)) {
      replace_truncated(fd, st);
      continue;
    }
    Mapping map(fd.get());
    std::uint64_t carried = 0;
    const Found found = examine(map, carried);
    if (found == Found::torn) continue;  // truncated while we looked: look again
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

StateFile::Found StateFile::examine(const Mapping& map, std::uint64_t& carried) const {
  std::atomic<bool> torn{false};
  Found found;
  {
    MappingAccess access(map.get(), sizeof(Header), torn);
    const Header& h = *map.get();
    if (h.magic == kMagic && h.version == 1) {
      found = same_boot(h) ? Found::older_version : Found::earlier_boot;  // same size and counter position
      carried = h.next_seq;
    } else if (h.magic != kMagic || h.version != kVersion) {
      found = Found::foreign;
    } else if (!same_boot(h)) {
      found = Found::earlier_boot;
      carried = h.next_seq;
    } else if (h.name_length != name_.size() || std::memcmp(h.name, name_.data(), name_.size()) != 0) {
      found = Found::other_name;
    } else {
      found = Found::ok;
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

// A state file of the wrong size: ours truncated (its queue is gone) is replaced once no entry
// still alive holds its bytes (each holder is told by its own check); anything else is refused.
void StateFile::replace_truncated(const Fd& fd, const struct stat& st) {
  std::uint32_t magic = 0;
  const bool ours = st.st_size < static_cast<off_t>(sizeof magic) ||
                    (pread(fd.get(), &magic, sizeof magic, 0) == sizeof magic && magic == kMagic);
  if (!ours || st.st_size > static_cast<off_t>(sizeof(Header))) {
    throw BackendUnavailable("the state file of '" + name_ + "' has an unexpected size (another turnstile version?)");
  }
  // An earlier version's file (smaller: version 2 kept no labels) starts as ours does. Written
  // in this boot, processes of that version may use it (and a PermitCounter's count lives in it
  // unlocked): never taken over. From an earlier boot: replaced, keeping the fencing counter.
  static_assert(offsetof(Header, version) == 4 && offsetof(Header, boot_id) == 8);
  struct {
    std::uint32_t magic, version;
    char boot_id[40];
  } start{};
  std::uint64_t next_seq = 0;
  if (st.st_size >= static_cast<off_t>(offsetof(Header, next_seq) + sizeof next_seq) &&
      pread(fd.get(), &start, sizeof start, 0) == static_cast<ssize_t>(sizeof start) &&
      pread(fd.get(), &next_seq, sizeof next_seq, offsetof(Header, next_seq)) ==
          static_cast<ssize_t>(sizeof next_seq) &&
      start.magic == kMagic && start.version != 0 && start.version < kVersion) {
    if (same_boot(start.boot_id)) refuse(Found::older_version);
    replace(st.st_ino, next_seq);
    return;
  }
  if (is_locked(fd.get(), kByteBase, 0)) {
    throw StateFileInUse("the state file of '" + name_ +
                         "' was truncated and is still used by a live "
                         "process (which is told its hold is lost); try again once it has let go");
  }
  replace(st.st_ino, 0);
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
  // those are backed first (the header and the first slots now, later ones as they are reached).
  if (ftruncate(fd.get(), sizeof(Header)) != 0) fail_io("ftruncate");
  back_with_storage(fd.get(), 0, offsetof(Header, slots) + sizeof(Slot), name_);
  initialise(*Mapping(fd.get()).get());
  if (pins_->pinned(pin_byte_)) {
    struct stat now {};
    if (fstatat(root_fd_, state_name_.c_str(), &now, AT_SYMLINK_NOFOLLOW) == 0) return;  // made meanwhile: open it
    // The name's file was removed or moved away while a process holds something of it.
    throw BackendUnavailable("the state file of '" + name_ + "' was removed while a live process still holds '" +
                             name_ + "' (it is told its hold is lost); try again once it has let go");
  }
  if (linkat(root_fd_, temp.c_str(), root_fd_, state_name_.c_str(), 0) != 0 && errno != EEXIST) {
    fail_io("cannot publish the state of '" + name_ + "'");
  }
}

// ---- descriptions --------------------------------------------------------------------------

Fd StateFile::checkout_descriptor() {
  {
    std::lock_guard lock(pool_mutex_);
    if (!pool_.empty()) {
      Fd fd = std::move(pool_.back());
      pool_.pop_back();
      return fd;
    }
  }
  // Reopen through /proc so the new description is of this very file, even if the path changed.
  const std::string self = "/proc/self/fd/" + std::to_string(fd_.get());
  Fd fd(open(self.c_str(), O_RDWR | O_CLOEXEC));
  if (!fd) fail_io("cannot reopen the state of '" + name_ + "'");
  return fd;
}

void StateFile::return_descriptor(Fd fd) {
  std::lock_guard lock(pool_mutex_);
  if (pool_.size() < kSpareDescriptors) pool_.push_back(std::move(fd));
}

// ---- the slots, under the guard ------------------------------------------------------------

std::ptrdiff_t StateFile::find(std::uint64_t seq) const {
  const Header& h = *map_.get();
  for (std::size_t i = 0; i < h.count; ++i) {
    if (h.slots[i].seq == seq) return static_cast<std::ptrdiff_t>(i);
  }
  return -1;
}

// Writes whose order matters to a process that finds our state after we were killed between
// two of them: the compiler must not reorder them (the CPU commits a dead thread's stores too).
void StateFile::append(const Slot& slot, const std::string& label) {
  auto& h = header();
  // A slot that reaches a page no slot reached before: backed first (see back_with_storage).
  const auto begin = offsetof(Header, slots) + h.count * sizeof(Slot);
  if ((begin + sizeof(Slot) - 1) / kPage != (begin - 1) / kPage)
    back_with_storage(fd_.get(), begin, sizeof(Slot), name_);
  h.slots[h.count] = slot;
  h.slots[h.count].label = 0;
  if (!label.empty()) {
    // A place no slot points to (there are as many places as slots, so one is free).
    std::bitset<kCapacity> used;
    for (std::size_t i = 0; i < h.count; ++i) {
      if (h.slots[i].label != 0 && h.slots[i].label <= kCapacity) used.set(h.slots[i].label - 1u);
    }
    std::size_t free = 0;
    while (used.test(free)) ++free;
    const auto length = std::min(label.size(), kMaxLabel);
    back_with_storage(fd_.get(), offsetof(Header, labels) + free * sizeof(Label), length + 1, name_);
    std::memcpy(h.labels[free].text, label.data(), length);
    h.labels[free].text[length] = '\0';
    h.slots[h.count].label = static_cast<std::uint16_t>(free + 1);
  }
  h.next_seq = slot.seq;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  ++h.count;  // only after the slot is written: a crash leaves no half entry
}

std::string StateFile::label_of(const Slot& slot) const {
  if (slot.label == 0 || slot.label > kCapacity) return {};
  const auto& text = map_.get()->labels[slot.label - 1u].text;
  return std::string(text, strnlen(text, kMaxLabel));
}

void StateFile::remove_at(std::size_t index) {
  // Slot by slot towards the front, each slot's seq cleared first and written last: killed at
  // any point, we leave complete slots (one possibly twice, identical) and at most one slot
  // with seq 0, which repair() drops. A memmove could leave a torn slot with a valid seq.
  auto& h = header();
  for (std::size_t i = index; i + 1 < h.count; ++i) {
    Slot& to = h.slots[i];
    const Slot& from = h.slots[i + 1];
    std::atomic_ref<std::uint64_t>(to.seq).store(0, std::memory_order_relaxed);
    std::atomic_signal_fence(std::memory_order_seq_cst);
    to.permits = from.permits;
    to.since_ns = from.since_ns;
    to.pid = from.pid;
    to.kind = from.kind;
    to.label = from.label;
    std::atomic_signal_fence(std::memory_order_seq_cst);
    std::atomic_ref<std::uint64_t>(to.seq).store(from.seq, std::memory_order_relaxed);
    std::atomic_signal_fence(std::memory_order_seq_cst);
  }
  --h.count;
}

void StateFile::remove(std::uint64_t seq) {
  if (const auto index = find(seq); index >= 0) remove_at(static_cast<std::size_t>(index));
  recompute_mode();
}

bool StateFile::remove_if_dead(std::uint64_t seq) {
  const auto index = find(seq);
  if (index < 0 || is_locked(fd_.get(), byte_offset(seq, Byte::life), 1)) return false;
  remove_at(static_cast<std::size_t>(index));
  recompute_mode();
  return true;
}

void StateFile::sweep_dead() {
  auto& h = header();
  for (std::size_t i = 0; i < h.count;) {
    if (!is_locked(fd_.get(), byte_offset(h.slots[i].seq, Byte::life), 1)) {
      remove_at(i);
    } else {
      ++i;
    }
  }
  recompute_mode();
}

void StateFile::recompute_mode() {
  auto& h = header();
  for (std::size_t i = 0; i < h.count; ++i) {
    if (h.slots[i].kind != kCounterWaiter) return;
  }
  h.mode = Mode::none;
  h.limit = 0;
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
  MappingAccess access(map_.get(), sizeof(Header), broken_);
  std::atomic_ref<std::uint32_t>(header().counter_epoch).fetch_add(1, std::memory_order_relaxed);
  futex_wake_all(&header().counter_epoch);
}

// ---- validity and pins ---------------------------------------------------------------------

bool StateFile::pin_if_current() {
  pins_->pin(pin_byte_);
  struct stat now {};
  if (fstatat(root_fd_, state_name_.c_str(), &now, AT_SYMLINK_NOFOLLOW) == 0 && now.st_dev == dev_ &&
      now.st_ino == ino_) {
    return true;
  }
  pins_->unpin(pin_byte_);
  return false;
}

void StateFile::unpin() { pins_->unpin(pin_byte_); }

bool StateFile::still_valid() {
  if (broken()) return false;
  struct stat mine {
  }, now{};
  if (fstat(fd_.get(), &mine) != 0 || mine.st_nlink == 0 || mine.st_size != static_cast<off_t>(sizeof(Header))) {
    return false;
  }
  if (fstatat(root_fd_, state_name_.c_str(), &now, AT_SYMLINK_NOFOLLOW) != 0) return false;
  if (now.st_dev != dev_ || now.st_ino != ino_) return false;
  MappingAccess access(map_.get(), sizeof(Header), broken_);
  return header().magic == kMagic && !broken();
}

}  // namespace turnstile::detail::file_state
