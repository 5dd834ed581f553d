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

// The mapping of a state file (the whole Header), unmapped when destroyed.
class Mapping {
 public:
  Mapping() = default;
  explicit Mapping(int fd);  // maps it, or throws (fail_io)
  ~Mapping();
  Mapping(Mapping&& other) noexcept : header_(std::exchange(other.header_, nullptr)) {}
  Mapping& operator=(Mapping&& other) noexcept;
  Header* get() const { return header_; }
  Header* operator->() const { return header_; }

 private:
  Header* header_ = nullptr;
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
    ~Guard();
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;

   private:
    StateFile& file_;
    MappingAccess access_;
  };

  Header& header() { return *map_.get(); }
  const std::string& name() const { return name_; }
  int probe_fd() const { return fd_.get(); }
  std::uint64_t generation() const { return generation_; }

  // A fresh open file description for one contender: OFD locks of one description never
  // conflict with each other, so contenders in one process must not share one.
  Fd checkout_descriptor();
  // Takes back a description that holds no locks (kept as a spare, or closed).
  void return_descriptor(Fd fd);
  // Sleeps until one of the bytes is released (by leaving or by death), the deadline passes or
  // a stop is requested.
  void wait_for_any_release(const std::vector<off_t>& offsets, Deadline deadline, const std::stop_token& stop) {
    watches_.wait_for_any_release(offsets, deadline, stop);
  }

  // Under the guard:
  std::ptrdiff_t find(std::uint64_t seq) const;
  // Appends `slot`, with `label` (if any) stored in a free place of the label table.
  void append(const Slot& slot, const std::string& label);
  // The label of a slot ("" when none or unreadable).
  std::string label_of(const Slot& slot) const;
  void remove_at(std::size_t index);
  // Removes our own slot, if still there (a slot of ours never held by anyone else).
  void remove(std::uint64_t seq);
  bool remove_if_dead(std::uint64_t seq);
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
  // Pins the name on the directory (see DirectoryPins) for one hold, and says whether this file
  // is still the one at its path. Pinned first, checked after: a file found in place was in
  // place when the pin was taken, so whoever creates a new one later sees the pin. Unpins and
  // returns false otherwise.
  bool pin_if_current();
  void unpin();

 private:
  enum class Found { ok, torn, foreign, older_version, earlier_boot, other_name };
  void open_or_create();
  Found examine(const Mapping& map, std::uint64_t& carried) const;
  void refuse(Found found) const;
  void replace_truncated(const Fd& fd, const struct stat& st);
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
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  ByteWatches watches_{[this] { return checkout_descriptor(); }};
};

}  // namespace turnstile::detail::file_state
