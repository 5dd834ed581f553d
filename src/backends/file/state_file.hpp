// SPDX-License-Identifier: Apache-2.0
// One name's state file (layout in state.hpp), mapped by every process using the name: opening
// or creating it, its robust mutex (Guard) and the repair after a crash, the queue's slots, and
// the descriptors and lock bytes its entries own. Also what every descriptor of the embedded
// backend needs: close-on-exec, and closing in a forked child (see file_backend.cpp).
#pragma once

#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

#include "backends/file/byte_watch.hpp"
#include "backends/file/local_entries.hpp"
#include "backends/file/os.hpp"
#include "backends/file/state.hpp"
#include "turnstile/deadline.hpp"

namespace turnstile::detail::file_state {

class DirectoryPins;

// Our state file was truncated and a live process still holds bytes of it (a holder told of
// the loss, or a waiter about to join again): it is replaced once they have let go.
class StateFileInUse : public BackendUnavailable {
 public:
  using BackendUnavailable::BackendUnavailable;
};

// The mapping of a state file: address room for the largest file (kMaxCapacity slots) is
// reserved at once, so the header and the slots never move; the slots are mapped as far as the
// file's capacity reaches, and further as it grows (extend). Unmapped when destroyed.
class Mapping {
 public:
  static constexpr std::size_t kReserved = file_size(kMaxCapacity);
  Mapping() = default;
  explicit Mapping(int fd);  // maps the header and the first kFirstCapacity slots, or throws
  ~Mapping();
  Mapping(Mapping&& other) noexcept
      : header_(std::exchange(other.header_, nullptr)), capacity_(other.capacity_.exchange(0)) {}
  Mapping& operator=(Mapping&& other) noexcept;
  Header* get() const { return header_; }
  Header* operator->() const { return header_; }
  Slot* slots() const { return slots_of(header_); }
  // How many slots are mapped (read without the guard too: at_its_path).
  std::size_t capacity() const { return capacity_.load(std::memory_order_acquire); }
  // Maps the slots up to `capacity` (more than mapped now); false if the system refused.
  bool extend(int fd, std::size_t capacity) noexcept;

 private:
  Header* header_ = nullptr;
  std::atomic<std::size_t> capacity_{0};
};

// While it lives, a SIGBUS on the mapping (the file was truncated under us) replaces the mapping
// with zeroed private memory and sets `broken`, so the access completes harmlessly and the
// caller reports the loss. Other SIGBUSes go to the handler installed before ours.
class MappingAccess {
 public:
  MappingAccess(void* base, std::size_t size, std::atomic<bool>& broken);
  ~MappingAccess();
  MappingAccess(const MappingAccess&) = delete;
  MappingAccess& operator=(const MappingAccess&) = delete;

 private:
  char* base_;
  std::size_t size_;
  std::atomic<bool>* broken_;
  MappingAccess* previous_;
  static void on_sigbus(int signal, siginfo_t* info, void* context);
  static void install_sigbus_handler();
  friend class StateFile;
};

// The description that owns one entry's lock bytes (state.hpp: 2^40 + 4·seq + byte). An entry
// admitted as it joins has one of its own, so that its release drops all of its locks with one
// whole-file unlock (the kernel allocates no lock record for that). An entry that waits uses the
// one description this process shares for a name's waiting entries (StateFile::share_description):
// OFD locks of one description on different bytes coexist, so any number of waiting entries cost
// one descriptor, and each drops only its own bytes. Never used to wait on another entry's byte
// (it would take that byte at once if it is one of ours): StateFile::sleep_until_free.
class EntryFd {
 public:
  EntryFd() = default;
  explicit EntryFd(Fd own) : own_(std::move(own)) {}
  int get() const { return shared_ ? shared_->get() : own_.get(); }
  explicit operator bool() const { return shared_ != nullptr || static_cast<bool>(own_); }
  // Forgets the description: an own one is closed (which drops its locks), the shared one only
  // left (its other entries keep theirs).
  void reset() noexcept {
    own_.reset();
    shared_.reset();
  }

 private:
  friend class StateFile;
  Fd own_;
  std::shared_ptr<Fd> shared_;
};

class StateFile {
 public:
  StateFile(int root_fd, std::shared_ptr<DirectoryPins> pins, std::string name);
  // Whether the state file of `name` exists in the directory (nothing is created).
  static bool exists(int root_fd, const std::string& name);
  ~StateFile();
  StateFile(const StateFile&) = delete;
  StateFile& operator=(const StateFile&) = delete;

  // Holds the robust mutex; repairs the state when its last owner died inside. Accesses to the
  // mapping under it survive a truncation (see MappingAccess): check broken() before trusting
  // what was read, and check_intact() before handing out a result.
  class Guard {
   public:
    explicit Guard(StateFile& file);
    // Takes the mutex only if it is free at once (owns() says whether it did): for work that
    // may be skipped, which must never wait on a process paused inside it.
    Guard(StateFile& file, std::try_to_lock_t);
    ~Guard();
    bool owns() const { return owns_; }
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;

   private:
    void after_lock(int rc);
    void unlock_telling_woken() noexcept;

    StateFile& file_;
    MappingAccess access_;
    bool owns_ = true;
  };

  Header& header() { return *map_.get(); }
  // Under the guard: the queue's slots (Header::count of them in use). Mapped for as many as the
  // file has room for, whatever process grew it (the guard maps what another one added).
  Slot& slot(std::size_t index) { return map_.slots()[index]; }
  const Slot& slot(std::size_t index) const { return map_.slots()[index]; }
  std::size_t count() const { return map_.get()->count; }
  // Whether the queue is at its largest (kMaxCapacity): no entry can be added.
  bool full() const { return count() >= kMaxCapacity; }
  const std::string& name() const { return name_; }
  // The directory entry names of this name's files start with base() (state.hpp, values.hpp).
  const std::string& base() const { return base_; }
  static std::string base_of(const std::string& name);
  int root_fd() const { return root_fd_; }
  // The value file of entry `seq` (Slot::flags kHasValue).
  std::string value_file(std::uint64_t seq) const { return base_ + ".v." + std::to_string(seq); }
  int probe_fd() const { return fd_.get(); }
  std::uint64_t generation() const { return generation_; }

  // A fresh open file description for one contender: OFD locks of one description never
  // conflict with each other, so contenders in one process must not share one.
  Fd checkout_descriptor();
  // Takes back a description that holds no locks (kept as a spare, or closed).
  void return_descriptor(Fd fd);
  // For an entry that is to wait (before its bytes are locked): `fd`, checked out for it, is
  // swapped for this process's shared description of the name (made from `fd` if none is open).
  void share_description(EntryFd& fd);
  // Drops the lock bytes of entry `seq` (0: none locked yet) and gives `fd` up: an own
  // description goes back to the pool, or is closed if its locks could not be dropped (closing
  // drops them). On the shared one only seq's bytes are unlocked; if that fails, the description
  // is retired (no new entry uses it) and closed with its last entry, which drops the bytes left.
  void let_go(EntryFd& fd, std::uint64_t seq) noexcept;
  // Sleeps in the kernel until `byte` is free, on a spare description that holds no locks.
  void sleep_until_free(off_t byte);
  // Sleeps until one of the bytes is released (by leaving or by death), the deadline passes or
  // a stop is requested.
  void wait_for_any_release(const std::vector<off_t>& offsets, Deadline deadline, const std::stop_token& stop) {
    watches_.wait_for_any_release(offsets, deadline, stop);
  }
  ByteWatches& byte_watches() { return watches_; }
  // This client's entries in the file, which wake its armed waiters themselves (arm_for_release).
  LocalEntries& local_entries() { return local_; }

  // Under the guard:
  std::ptrdiff_t find(std::uint64_t seq) const;
  // Appends `slot` (the file grows when the queue fills it), with `label` (if any) in the place
  // of the label table that holds it already, or in a free one.
  void append(const Slot& slot, const std::string& label);
  // The label of a slot ("" when none or unreadable).
  std::string label_of(const Slot& slot) const;
  void remove_at(std::size_t index);
  // An entry ends: its slot goes, then its value file if it has one (a crash in between leaves
  // only a value file no slot refers to).
  void end_entry_at(std::size_t index);
  // Removes our own slot, if still there (a slot of ours never held by anyone else).
  void remove(std::uint64_t seq);
  bool remove_if_dead(std::uint64_t seq);
  // An entry is alive while its life byte is locked, or while it is kept (Slot::kept_until_ns).
  static bool kept(const Slot& slot);
  bool alive(const Slot& slot) const;
  // When the kept entry `seq` ends (CLOCK_BOOTTIME ns); 0 when it is not kept (or gone).
  std::int64_t kept_until(std::uint64_t seq) const;
  void sweep_dead();
  void recompute_mode();
  // The PermitCounter doorbell: its epoch, and waking its sleepers after permits appeared.
  std::uint32_t counter_epoch();
  void ring_counter();
  // Not under the guard (a stop callback): wakes every sleeper, which looks again.
  void wake_counter_waiters();
  // The state was truncated or overwritten under us: nothing read from it can be trusted.
  bool broken() const { return broken_.load(std::memory_order_relaxed); }
  void check_intact() const;

  // Whether the state file is still the one at its path, whole: a removed, replaced or
  // truncated file means the holds it records no longer exclude anyone.
  bool still_valid();
  // Whether this file is still the one at its path, whole (one fstatat: same device and inode,
  // at least the size mapped).
  bool at_its_path() const;
  // Whether this file was unlinked (rm, or replaced by a rename over it) or is no longer whole
  // (one fstat, cheaper than the path lookup of at_its_path: 0.4 against 0.9 µs).
  bool unlinked_or_cut() const;
  // The name's pin on the directory (see DirectoryPins) is taken for the first hold of this file
  // and kept while the file is the name's current one in this client (no system call for later
  // holds), until stop_keeping_pin(); a file no longer kept is pinned per hold, as before.
  enum class HoldPin { pinned, newly_kept, not_in_place };
  // For one hold: pins the name unless this file keeps it pinned, and says whether this file is
  // still the one at its path. Pinned first, checked after: a file found in place was in place
  // when the pin was taken, so whoever creates a new one later sees the pin. A file kept pinned
  // needs only an fstat (still linked, whole), none when `checked`: the caller's join found it
  // so (FileBackend::file) and has not waited since. Not in place: no longer kept pinned.
  HoldPin pin_for_hold(bool checked);
  // A hold of this file ended: the pin goes with the last one once the file is no longer kept.
  void hold_ended();
  // This file is no longer the name's current one here (removed, replaced, closed): its pin
  // goes now, or with its last hold.
  void stop_keeping_pin();
  // For the watcher: whether the file still keeps a pin. An idle file (no hold) found gone from
  // its path (rm, a tmp cleaner) stops keeping it, so nobody is kept from making the name afresh
  // by a process that merely used the name before.
  bool keeps_pin_in_place();
  // Removes the state file from the directory when nothing uses it: no entry (dead ones swept
  // first), no PermitCounter value, nobody pins the name, and it is still the file at its path;
  // and marks it removed (Header::removed) before its mutex is let go. Whoever opened it before
  // sees the mark under the guard before adding anything and uses the file now at the path.
  // Says whether it was removed.
  bool remove_if_unused();
  // Whether remove_if_unused removed this file. Checked under the guard, a file not marked stays
  // in place until the guard ends (removal happens under it), and a file with an entry or a
  // counter value is never removed as unused, so whoever adds one after the check keeps the
  // file in place. Also read without the guard (file() drops a marked file it kept open): the
  // file's link count alone does not tell, as a creator's temporary name may still link it.
  bool removed_as_unused();

 private:
  enum class Found { ok, torn, cut, foreign, older_version, earlier_boot, other_name };
  void open_or_create();
  // Whether `fd` starts as a file of this version, large enough to map.
  static bool looks_current(const Fd& fd, const struct stat& st);
  Found examine(const Fd& fd, const Mapping& map, std::uint64_t& carried) const;
  void refuse(Found found) const;
  void replace_truncated(const Fd& fd, const struct stat& st);
  void replace_cut(const Fd& fd, const struct stat& st, std::uint64_t carried);
  // Under the guard: maps the slots another process added by growing the file (one compare when
  // none did); a capacity no file of ours has, or one that cannot be mapped, breaks the file.
  void fit_mapping() noexcept;
  // Under the guard: doubles the room for slots (the file first, then Header::capacity).
  void grow();
  std::uint16_t place_label(const std::string& label);
  // Under the guard: gives back the pages of slots no longer in use once the queue is a quarter
  // of what they were backed for (the file keeps its size; the pages read as zeros).
  void give_back_pages();
  void create();
  // A state file another user of a directory its group shares made: the directory's group's,
  // and nobody outside it may write to it.
  bool made_by_the_group(const struct stat& file) const;
  void initialise(Header& header) const;
  void replace(ino_t ino, std::uint64_t carried_seq);
  void repair();

  std::string name_;
  std::string base_;
  std::string state_name_;
  int root_fd_;
  std::shared_ptr<DirectoryPins> pins_;
  off_t pin_byte_;
  Fd fd_;
  Mapping map_;
  std::atomic<bool> broken_{false};
  std::uint64_t generation_ = current_generation();
  std::mutex pool_mutex_;
  std::vector<Fd> pool_;
  std::weak_ptr<Fd> shared_;  // the waiting entries' description, while one uses it
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  void release_pin_locked();
  void let_go_shared(EntryFd& fd, std::uint64_t seq) noexcept;
  std::mutex pin_mutex_;  // the pin's state:
  bool pinned_ = false;
  bool keep_pin_ = true;
  std::size_t holds_ = 0;
  ByteWatches watches_{[this] { return checkout_descriptor(); }};
  LocalEntries local_;
};

}  // namespace turnstile::detail::file_state
