// SPDX-License-Identifier: Apache-2.0
// The embedded backend, file:// (processes and threads of one host, no server): the queue
// storage the core's loop runs on (queue_store.hpp). This header is its table of contents.
//
// Each name has a small state file under the root directory, mapped into every process that
// uses it (layout in state.hpp). Its header holds a process-shared robust mutex, the fencing
// counter and the queue (slots in arrival order). Joining and evaluating happen under the mutex
// in one step, so the storage reports its verdict (`Standing::decided`). Liveness never comes
// from clocks or process ids: every entry owns open-file-description (OFD) locks on bytes of the
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
//
// Files: this header (the backend, a hold, a place in the queue, a PermitCounter's line);
// file_backend.cpp (the backend: its state files, joining, inspecting, fork), file_place.cpp
// (a place in the queue), file_hold.cpp (a hold and the watcher of held names' files),
// collect.cpp (removing the state files nobody uses: turnstile gc), values.* (election
// candidates' values), leader_watch.cpp (what wakes a LeaderObserver),
// counter_line.cpp (PermitCounter), entry_slot.* (what every entry does alike), state_file.*
// (one name's state file), directory.* (the root directory), byte_watch.* (waits on lock bytes),
// local_entries.* (async waiters woken by our own entries, without a thread each).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "backends/file/directory.hpp"
#include "backends/file/state_file.hpp"
#include "core/backend.hpp"
#include "core/call_budget.hpp"

namespace turnstile::detail {

using file_state::current_generation;
using file_state::DirectoryPins;
using file_state::EntryFd;
using file_state::Fd;
using file_state::ForkLocked;
using file_state::Header;
using file_state::register_for_fork;
using file_state::StateFile;

class FileHold;

// How many times in a row a join or a counter operation may find the file it opened removed as
// unused (each time someone else used the name and left in between) before it gives up, with
// this BackendUnavailable.
constexpr int kRemovedRetries = 100;
[[noreturn]] inline void throw_keeps_being_removed(const std::string& name) {
  throw BackendUnavailable("the state file of '" + name + "' keeps being removed under us");
}

// One client's view of a root directory of state files.
class FileBackend final : public Backend, public ForkLocked {
 public:
  FileBackend(std::string root, Fd root_fd, std::string holder_label)
      : root_(std::move(root)), root_fd_(std::move(root_fd)), holder_label_(std::move(holder_label)) {
    register_for_fork(this);
  }
  ~FileBackend() override;

  // ---- the queue (file_backend.cpp; the place itself is FilePlace, file_place.cpp)
  std::unique_ptr<QueuePlace> join(const QueueRequest& request, bool try_once, Deadline deadline,
                                   Standing& first) override;
  Inspection inspect(const std::string& name, Deadline deadline) override;
  // Every name with a state file in the directory (state_names.cpp); local: no call to bound.
  QueueNames queue_names(const std::string& prefix, std::size_t max_names, Deadline deadline) override;
  // The state files of names under `prefix` nobody uses, and leftovers of crashed creators
  // (collect.cpp).
  std::vector<std::string> collect_unused(const std::string& prefix) override;
  bool keeps_released_holds(EntryKind) const override { return true; }  // a kept slot (state.hpp)
  bool tries_locally() const override { return true; }                  // decided under the state file's mutex
  // Elections: candidates' values in value files beside the state file (values.hpp).
  bool has_elections() const override { return true; }
  // Woken by the leader's life byte and by the directory's events for the name's value files
  // (leader_watch.cpp): no thread of its own.
  std::unique_ptr<LeaderWatch> watch_leader(const std::string& name) override;
  const std::string& holder_label() const { return holder_label_; }

  // ---- PermitCounter (counter_line.cpp)
  std::unique_ptr<CounterLine> counter_line(const std::string& name, std::int64_t permits,
                                            const std::stop_token& stop) override;
  bool counter_try_set(const std::string& name, std::int64_t permits) override;
  std::int64_t counter_add(const std::string& name, std::int64_t delta) override;
  std::optional<std::int64_t> counter_get(const std::string& name) override;
  std::int64_t counter_drain(const std::string& name) override;

  // ---- the watcher of held names' state files (file_hold.cpp)
  void watch(FileHold* hold);
  void unwatch(FileHold* hold);
  // Has the watcher look, while `file` keeps its name pinned with no hold, whether it is still
  // at its path (StateFile::keeps_pin_in_place).
  void check_kept_pin(const std::shared_ptr<StateFile>& file);

  // ---- the state files (file_backend.cpp)
  // Forgets `file` (no longer the file at its path): the next file(name) opens the current one.
  void forget(const std::shared_ptr<StateFile>& file);
  // file(name) for a join that may wait: a truncated file still in use is waited for until it
  // can be replaced (nullptr when the budget passes first).
  std::shared_ptr<StateFile> file_to_join(const std::string& name, bool try_once, const CallBudget& budget);

  // ---- fork (os.hpp): no file or watcher lock is held across fork()
  void lock_for_fork() override {
    files_mutex_.lock();
    watch_->mutex.lock();
  }
  void unlock_after_fork() override {
    watch_->mutex.unlock();
    files_mutex_.unlock();
  }

 private:
  std::shared_ptr<StateFile> file(const std::string& name);
  void reopen_root_if_removed();
  // Closes the files only this map refers to (of the names `closing` accepts), removing those
  // nobody uses.
  template <class Predicate>
  void close_idle_files(Predicate closing);
  // Under files_mutex_: in a forked child, drops the parent's files and opens the directory anew.
  void adopt_after_fork_locked();
  // Whether `name` has a state file (nothing is created).
  bool has_state(const std::string& name);
  bool remove_state_if_unused(const std::string& name);
  bool remove_value_if_orphan(const std::string& file_name, const std::string& prefix);
  // Runs `operation(StateFile&)` under the guard of the name's state file, once it is one still
  // linked (counter_line.cpp).
  template <class Operation>
  auto with_linked_file(const std::string& name, Operation operation);
  struct WatchState;
  static void watch_loop(const std::shared_ptr<WatchState>& state);
  static void check_kept_pins(WatchState& state, std::unique_lock<std::mutex>& lock);
  void adopt_watch_after_fork_locked();

  std::string root_;
  Fd root_fd_;
  std::string holder_label_;  // kept with our entries, for inspect
  std::uint64_t generation_ = current_generation();
  std::vector<Fd> removed_root_fds_;  // still named by StateFiles that outlive their directory
  std::shared_ptr<DirectoryPins> pins_ = std::make_shared<DirectoryPins>(root_fd_.get());
  std::mutex files_mutex_;
  std::unordered_map<std::string, std::shared_ptr<StateFile>> files_;

  // The watcher's state, shared with its thread, which may outlive the backend (see ~FileBackend).
  struct WatchState {
    std::mutex mutex;
    std::condition_variable cv;
    // An intrusive list through the holds themselves: watching costs no allocation per acquire.
    FileHold* holds = nullptr;
    struct KeptPin {
      const StateFile* file;
      std::weak_ptr<StateFile> owner;
    };
    std::vector<KeptPin> kept_pins;  // files keeping their name pinned (StateFile::pin_for_hold)
    bool started = false;
    bool stop = false;
    bool checking = false;  // the thread is checking files, outside the mutex
    std::thread::id thread;
    std::uint64_t generation = current_generation();  // of the thread (a child has none)
  };
  std::shared_ptr<WatchState> watch_ = std::make_shared<WatchState>();
};

// ---- a hold --------------------------------------------------------------------------------

class FileHold final : public BackendHold {
 public:
  FileHold(FileBackend& backend, std::shared_ptr<StateFile> file, EntryFd fd, std::uint64_t seq, EntryKind kind,
           std::shared_ptr<LossSignal> loss)
      : backend_(backend), file_(std::move(file)), fd_(std::move(fd)), seq_(seq), kind_(kind), loss_(std::move(loss)) {
    try {
      backend_.watch(this);
    } catch (...) {
      file_->hold_ended();  // counted for this hold by pin_for_hold()
      throw;
    }
  }
  ~FileHold() override {
    try {
      release();
    } catch (...) {
      // Our bytes go unannounced: the waiters armed on them look again.
      if (fd_) {
        file_->local_entries().abandon();
        file_->let_go(fd_, seq_);
      }
    }
  }

  std::uint64_t fencing_token() const override { return seq_; }

  // An exclusive entry becomes a shared one in place; readers behind it wake.
  void downgrade() override;
  void release() override { leave_keeping(0); }
  // Rewrites our value file while our slot is still there (file_hold.cpp).
  void proclaim(const std::string& value) override;
  // The slot stays, kept until then (Slot::kept_until_ns); the lock bytes go as on release.
  void release_after(std::chrono::milliseconds keep_for) override;

  const std::shared_ptr<StateFile>& file() const { return file_; }
  const std::shared_ptr<LossSignal>& loss() const { return loss_; }

  FileHold* watch_prev = nullptr;  // FileBackend::WatchState::holds, under its mutex
  FileHold* watch_next = nullptr;

 private:
  // Leaves: removes our slot, or with `kept_until_ns` (CLOCK_BOOTTIME) keeps it until then.
  void leave_keeping(std::int64_t kept_until_ns);
  // A hold inherited through fork() is the parent's: the child never touches its entry or its
  // description (closed in the child at the fork).
  void refuse_if_inherited() {
    if (file_->generation() == current_generation()) return;
    fd_.reset();  // a parent's descriptor: not closed, only forgotten
    throw HoldLost("the hold on '" + file_->name() + "' (fencing token " + std::to_string(seq_) +
                   ") belongs to the process that forked this one: a child neither holds nor releases it");
  }

  FileBackend& backend_;
  std::shared_ptr<StateFile> file_;
  EntryFd fd_;
  std::uint64_t seq_;
  EntryKind kind_;
  std::shared_ptr<LossSignal> loss_;
};

// ---- a place in the queue ------------------------------------------------------------------

// Our entry in a name's queue: a slot of the state file, and the lock bytes it owns (on a
// description of its own, or, waiting, on the one the process shares: EntryFd).
class FilePlace final : public QueuePlace {
 public:
  FilePlace(FileBackend& backend, std::shared_ptr<StateFile> file, const QueueRequest& request)
      : backend_(backend), file_(std::move(file)), kind_(request.kind), permits_(request.permits),
        limit_(request.limit) {}
  ~FilePlace() override { leave(); }

  enum class Joined { in_queue, not_admitted, file_removed };
  // Adds our slot at the back and evaluates, in one step under the mutex. With `try_once` and
  // not admitted (dead entries ahead swept first), adds nothing: not_admitted. In a file
  // removed as unused since it was opened, adds nothing: file_removed (join the one at the path).
  Joined join(const QueueRequest& request, bool try_once, Standing& first);
  Standing look(Deadline deadline) override;
  void wait(const Verdict& verdict, Deadline deadline, const std::stop_token& stop) override;
  std::unique_ptr<WakeArm> arm(const Verdict& verdict, Deadline deadline, Wake wake) override;
  std::unique_ptr<BackendHold> hold(std::shared_ptr<LossSignal> loss) override;
  void leave() noexcept override;

 private:
  // Under the guard:
  void check_mode(const QueueRequest& request);
  Verdict evaluate_as_newcomer();
  void add_slot(Header& h, std::uint64_t seq, bool admitted, bool has_value);
  Standing decided(const Verdict& verdict, const Header& h) const;
  void remember_waited(const Verdict& verdict, const std::vector<std::uint64_t>& seqs, std::size_t ahead);
  bool sweep_dead_ahead();
  Deadline until_first_kept_end(std::vector<std::uint64_t>& waited, Deadline deadline);
  // The state file was truncated or overwritten under us: our entry went with it and nothing
  // was held, so the backend forgets the file and the core joins again, in the one replacing it.
  [[noreturn]] void gone_with_file();

  FileBackend& backend_;
  std::shared_ptr<StateFile> file_;
  EntryKind kind_;
  std::int64_t permits_;
  std::int64_t limit_;
  EntryFd fd_;
  std::uint64_t seq_ = 0;                  // 0: not in the queue
  std::vector<std::uint64_t> waited_for_;  // the entries the last look that waits names
  bool waited_ = false;                    // since the join found the file in place (file())
  bool check_waited_ = false;              // the next look removes those of them that died (a wait ended)
};

// ---- the PermitCounter's line --------------------------------------------------------------

// One PermitCounter acquire. In line, it owns a slot (kind kCounterWaiter) and its life byte;
// the first in line sleeps on the futex word that adders bump, the others on the life byte of
// the waiter just ahead.
class FileCounterLine final : public CounterLine {
 public:
  FileCounterLine(std::shared_ptr<StateFile> file, std::int64_t permits, const std::string& label)
      : file_(std::move(file)), permits_(permits), label_(label) {}
  ~FileCounterLine() override { leave(); }

  CounterStanding look(bool last_try, Deadline deadline) override;
  bool take(const CounterStanding& seen, Deadline deadline) override;
  void join(Deadline deadline) override;
  void wait(CounterWait wait, Deadline deadline, const std::stop_token& stop) override;
  std::unique_ptr<WakeArm> arm(CounterWait wait, Deadline deadline, Wake wake) override;
  bool leave() noexcept override;

 private:
  // Under the guard:
  CounterStanding read();
  bool take_if_first(const CounterStanding& standing);
  void wait_for_value(Deadline deadline, const std::stop_token& stop);
  void wait_for_predecessor(Deadline deadline, const std::stop_token& stop);

  std::shared_ptr<StateFile> file_;
  std::int64_t permits_;
  std::string label_;
  EntryFd fd_;
  std::uint64_t seq_ = 0;           // 0: not in line
  std::uint64_t predecessor_ = 0;   // the waiter just ahead at the last read
  bool check_predecessor_ = false;  // the next look removes it if it died (an armed wait)
  std::uint32_t epoch_ = 0;         // the doorbell at the last read
};

}  // namespace turnstile::detail
