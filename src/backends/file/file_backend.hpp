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
// counter_line.cpp (PermitCounter), entry_slot.* (what every entry does alike), state_file.*
// (one name's state file), directory.* (the root directory), byte_watch.* (waits on lock bytes).
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
using file_state::Fd;
using file_state::ForkLocked;
using file_state::Header;
using file_state::register_for_fork;
using file_state::StateFile;

class FileHold;

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
  // Under files_mutex_: in a forked child, drops the parent's files and opens the directory anew.
  void adopt_after_fork_locked();
  // Whether `name` has a state file (nothing is created).
  bool has_state(const std::string& name);
  struct WatchState;
  static void watch_loop(const std::shared_ptr<WatchState>& state);

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
  FileHold(FileBackend& backend, std::shared_ptr<StateFile> file, Fd fd, std::uint64_t seq, EntryKind kind,
           std::shared_ptr<LossSignal> loss)
      : backend_(backend), file_(std::move(file)), fd_(std::move(fd)), seq_(seq), kind_(kind), loss_(std::move(loss)) {
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

  // An exclusive entry becomes a shared one in place; readers behind it wake.
  void downgrade() override;
  void release() override;

  const std::shared_ptr<StateFile>& file() const { return file_; }
  const std::shared_ptr<LossSignal>& loss() const { return loss_; }

  FileHold* watch_prev = nullptr;  // FileBackend::WatchState::holds, under its mutex
  FileHold* watch_next = nullptr;

 private:
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
  Fd fd_;
  std::uint64_t seq_;
  EntryKind kind_;
  std::shared_ptr<LossSignal> loss_;
};

// ---- a place in the queue ------------------------------------------------------------------

// Our entry in a name's queue: a slot of the state file, and the lock bytes it owns on a
// description of its own.
class FilePlace final : public QueuePlace {
 public:
  FilePlace(FileBackend& backend, std::shared_ptr<StateFile> file, const QueueRequest& request)
      : backend_(backend), file_(std::move(file)), kind_(request.kind), permits_(request.permits),
        limit_(request.limit) {}
  ~FilePlace() override { leave(); }

  // Adds our slot at the back and evaluates, in one step under the mutex. With `try_once` and
  // not admitted (dead entries ahead swept first), adds nothing and returns false.
  bool join(const QueueRequest& request, bool try_once, Standing& first);
  Standing look(Deadline deadline) override;
  void wait(const Verdict& verdict, Deadline deadline, const std::stop_token& stop) override;
  std::unique_ptr<BackendHold> hold(std::shared_ptr<LossSignal> loss) override;
  void leave() noexcept override;

 private:
  // Under the guard:
  void check_mode(const QueueRequest& request);
  Verdict evaluate_as_newcomer(const Header& h);
  void add_slot(Header& h, std::uint64_t seq, bool admitted);
  Standing decided(const Verdict& verdict, const Header& h) const;
  bool sweep_dead_ahead();
  // The state file was truncated or overwritten under us: our entry went with it and nothing
  // was held, so the backend forgets the file and the core joins again, in the one replacing it.
  [[noreturn]] void gone_with_file();

  FileBackend& backend_;
  std::shared_ptr<StateFile> file_;
  EntryKind kind_;
  std::int64_t permits_;
  std::int64_t limit_;
  Fd fd_;
  std::uint64_t seq_ = 0;            // 0: not in the queue
  std::vector<std::uint64_t> seen_;  // the entries up to ours at the last look that waits
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
  Fd fd_;
  std::uint64_t seq_ = 0;          // 0: not in line
  std::uint64_t predecessor_ = 0;  // the waiter just ahead at the last read
  std::uint32_t epoch_ = 0;        // the doorbell at the last read
};

}  // namespace turnstile::detail
