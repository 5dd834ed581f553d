// The embedded backend: processes and threads of one host, no server. This file is the queue
// storage the core's loop runs on (queue_store.hpp); the state file itself is state_file.*, the
// directory directory.*, the waits on lock bytes byte_watch.*.
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
#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <condition_variable>
#include <thread>
#include <unordered_map>

#include "backends/file/directory.hpp"
#include "backends/file/state_file.hpp"
#include "core/backend.hpp"

namespace turnstile::detail {
namespace {

using namespace file_state;

// A client keeps at most this many names open while nothing of theirs is held or waited for
// (each with its file and at most 2 spare descriptions): what it keeps is bounded, whatever the
// number of names it ever used.
constexpr std::size_t kIdleNames = 16;
// How often held names' state files are checked to be still in place, whole: the bound on
// telling a holder that `rm -rf` or a tmp cleaner took its state file.
constexpr std::chrono::milliseconds kValidityCheckInterval{500};
// How often a joiner looks whether a truncated state file still in use has been let go (its
// last users are waiters that join again at once, or a holder told of the loss).
constexpr std::chrono::milliseconds kTruncatedFileRetry{10};

bool passed(Deadline deadline) { return deadline && *deadline <= SteadyClock::now(); }

// The fencing token (and sequence number) of a new entry: max(last + 1, CLOCK_REALTIME in µs),
// as on Redis. Strictly increasing while the state file lives, and still above every earlier
// token of the name when the file was removed, truncated or replaced (a cleaner, rm -rf), as
// long as the clock was not stepped back by more than the time since the last token.
// (2^40 + 4·token stays below the largest lock offset, 2^63 - 1, for some 70,000 years.)
std::uint64_t next_token(const Header& h) {
  const auto now_us = static_cast<std::uint64_t>(std::max<std::int64_t>(realtime_ns() / 1000, 0));
  return std::max(h.next_seq + 1, now_us);
}

QueueMode queue_mode(Mode mode) {
  return mode == Mode::lock ? QueueMode::lock : mode == Mode::semaphore ? QueueMode::semaphore : QueueMode::none;
}

[[noreturn]] void throw_full(const std::string& name) {
  throw QueueFull("'" + name + "' already has " + std::to_string(kCapacity) + " contenders");
}

// The queue's entries up to and including the one with `seq` (all of them when no slot has it),
// PermitCounter waiters left out. Thread-local and reused: no allocation once warm.
struct QueueScan {
  std::vector<QueueEntryView> views;
  std::vector<std::uint64_t> seqs;
  bool reached(std::uint64_t seq) const { return !seqs.empty() && seqs.back() == seq; }
};

QueueScan& scan_queue(const Header& h, std::uint64_t seq) {
  thread_local QueueScan scan;
  scan.views.clear();
  scan.seqs.clear();
  for (std::size_t i = 0; i < h.count; ++i) {
    const auto& slot = h.slots[i];
    if (slot.kind == kCounterWaiter) continue;
    scan.views.push_back({static_cast<EntryKind>(slot.kind), slot.permits});
    scan.seqs.push_back(slot.seq);
    if (slot.seq == seq) break;
  }
  return scan;
}

// Drops all of a description's locks (it holds only one entry's bytes): unlocking the whole file
// drops the same locks, and the kernel skips allocating the two lock records that splitting a
// range may need (a ranged unlock allocates them on every call).
bool unlock_all(const Fd& fd) { return set_lock(fd.get(), F_UNLCK, 0, 0, false); }

// Under the guard: removes our slot and drops its bytes; the description goes back to the pool.
void remove_slot(StateFile& file, std::uint64_t& seq, Fd& fd) {
  file.remove(std::exchange(seq, 0));
  if (fd && unlock_all(fd)) file.return_descriptor(std::move(fd));
  fd.reset();
}

// Leaves the queue or the line (never throws). A description whose locks could not be dropped
// is closed instead, which drops them: whoever finds the slot then removes it as dead.
void leave_slot(StateFile& file, std::uint64_t& seq, Fd& fd) noexcept {
  if (seq != 0) {
    try {
      StateFile::Guard guard(file);
      remove_slot(file, seq, fd);
    } catch (...) {
      seq = 0;
      fd.reset();
    }
  }
  if (fd) file.return_descriptor(std::move(fd));
}

// Whether a state file we hold open was removed from the tree, or is no longer whole.
bool stale(int fd) {
  struct stat st {};
  return fstat(fd, &st) != 0 || st.st_nlink == 0 || st.st_size != static_cast<off_t>(sizeof(Header));
}

class FileHold;

class FileBackend final : public Backend, public ForkLocked {
 public:
  FileBackend(std::string root, Fd root_fd, std::string holder_label)
      : root_(std::move(root)), root_fd_(std::move(root_fd)), holder_label_(std::move(holder_label)) {
    register_for_fork(this);
  }
  ~FileBackend() override;

  std::unique_ptr<QueuePlace> join(const QueueRequest& request, bool try_once, Deadline deadline,
                                   Standing& first) override;
  std::unique_ptr<CounterLine> counter_line(const std::string& name, std::int64_t permits,
                                            const std::stop_token& stop) override;
  Inspection inspect(const std::string& name, Deadline deadline) override;
  const std::string& holder_label() const { return holder_label_; }
  bool counter_try_set(const std::string& name, std::int64_t permits) override;
  std::int64_t counter_add(const std::string& name, std::int64_t delta) override;
  std::optional<std::int64_t> counter_get(const std::string& name) override;
  std::int64_t counter_drain(const std::string& name) override;

  void watch(FileHold* hold);
  void unwatch(FileHold* hold);
  // Forgets `file` (no longer the file at its path): the next file(name) opens the current one.
  void forget(const std::shared_ptr<StateFile>& file);
  // file(name) for a join that may wait: a truncated file still in use is waited for until it
  // can be replaced (nullptr when the deadline passes or a stop comes first).
  std::shared_ptr<StateFile> file_to_join(const std::string& name, bool try_once, Deadline deadline,
                                          const std::stop_token& stop);

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

  void downgrade() override {
    if (!fd_ || kind_ != EntryKind::exclusive) return;
    refuse_if_inherited();
    StateFile::Guard guard(*file_);
    if (auto index = file_->find(seq_); index >= 0) {
      file_->header().slots[index].kind = static_cast<std::uint8_t>(EntryKind::shared);
    }
    kind_ = EntryKind::shared;
    set_lock(fd_.get(), F_UNLCK, byte_offset(seq_, Byte::exclusive), 1, false);  // readers behind wake
  }

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

void FileHold::release() {
  if (!fd_) return;
  refuse_if_inherited();
  backend_.unwatch(this);
  bool found = false;
  bool broken;
  {
    StateFile::Guard guard(*file_);
    broken = file_->broken();
    if (!broken) {
      found = file_->find(seq_) >= 0;
      file_->remove(seq_);
    }
    unlock_all(fd_);
  }
  file_->return_descriptor(std::move(fd_));
  file_->unpin();
  if (broken) {
    loss_->lose("the state file of '" + file_->name() + "' was truncated or overwritten");
  } else if (!found) {
    loss_->lose("its entry vanished from the state file");
  }
}

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
  std::uint64_t seq_ = 0;                // 0: not in the queue
  std::vector<std::uint64_t> seen_;      // the entries up to ours at the last look that waits
};

Standing FilePlace::decided(const Verdict& verdict, const Header& h) const {
  Standing standing;
  standing.decided = verdict;
  standing.mode = queue_mode(h.mode);
  standing.limit = h.limit;
  return standing;
}

void FilePlace::check_mode(const QueueRequest& request) {
  const auto& h = file_->header();
  try {
    check_queue_mode(request, queue_mode(h.mode), h.limit);
  } catch (const Error&) {
    file_->sweep_dead();  // the entries that set the mode may belong to dead processes
    check_queue_mode(request, queue_mode(h.mode), h.limit);
  }
}

Verdict FilePlace::evaluate_as_newcomer(const Header& h) {
  auto& scan = scan_queue(h, 0);
  scan.views.push_back({kind_, permits_});
  scan.seqs.push_back(0);
  return evaluate_queue(scan.views, scan.views.size() - 1, limit_);
}

// Locks our bytes (life; exclusive for a writer; waiting for a lease still in line) and appends
// our slot; the mode is ours when the queue had none.
void FilePlace::add_slot(Header& h, std::uint64_t seq, bool admitted) {
  set_lock(fd_.get(), F_WRLCK, byte_offset(seq, Byte::life), kind_ == EntryKind::exclusive ? 2 : 1, false);
  if (kind_ == EntryKind::lease && !admitted) set_lock(fd_.get(), F_WRLCK, byte_offset(seq, Byte::waiting), 1, false);
  seq_ = seq;
  file_->append(Slot{seq, permits_, realtime_ns(), my_pid(), static_cast<std::uint8_t>(kind_), 0, 0},
                backend_.holder_label());
  if (h.mode == Mode::none) {
    h.mode = kind_ == EntryKind::lease ? Mode::semaphore : Mode::lock;
    h.limit = kind_ == EntryKind::lease ? limit_ : 0;
  }
}

bool FilePlace::join(const QueueRequest& request, bool try_once, Standing& first) {
  fd_ = file_->checkout_descriptor();
  StateFile::Guard guard(*file_);
  file_->check_intact();
  auto& h = file_->header();
  check_mode(request);
  if (h.count == kCapacity) file_->sweep_dead();
  if (h.count == kCapacity) throw_full(request.name);
  Verdict verdict = evaluate_as_newcomer(h);
  if (!verdict.admitted() && try_once) {
    // Nobody will wake us: those ahead must be alive before we fail.
    file_->sweep_dead();
    verdict = evaluate_as_newcomer(h);
    if (!verdict.admitted()) {
      file_->check_intact();
      return false;
    }
  }
  const std::uint64_t seq = next_token(h);
  if (!verdict.admitted()) {
    seen_ = scan_queue(h, 0).seqs;
    seen_.push_back(seq);
  }
  add_slot(h, seq, verdict.admitted());
  file_->check_intact();
  first = decided(verdict, h);
  return true;
}

void FilePlace::gone_with_file() {
  backend_.forget(file_);
  throw QueueEntryGone();
}

Standing FilePlace::look(Deadline) {
  {
    StateFile::Guard guard(*file_);
    if (!file_->broken()) {
      const auto& h = file_->header();
      const auto& scan = scan_queue(h, seq_);
      if (!scan.reached(seq_)) throw QueueEntryGone();
      const Verdict verdict = evaluate_queue(scan.views, scan.views.size() - 1, limit_);
      if (!verdict.admitted()) {
        seen_ = scan.seqs;
      } else if (kind_ == EntryKind::lease) {
        set_lock(fd_.get(), F_UNLCK, byte_offset(seq_, Byte::waiting), 1, false);  // the next lease looks again
      }
      if (!file_->broken()) return decided(verdict, h);  // else truncated while we read
    }
  }
  gone_with_file();  // outside the guard: forget() takes the backend's lock
}

// Every entry ahead holds and none is enough alone: any of them leaving or dying can admit us.
// Dead ones are removed first (their bytes are free already): true when one was.
bool FilePlace::sweep_dead_ahead() {
  StateFile::Guard guard(*file_);
  bool swept = false;
  for (std::size_t i = 0; i + 1 < seen_.size(); ++i) swept |= file_->remove_if_dead(seen_[i]);
  return swept;
}

void FilePlace::wait(const Verdict& verdict, Deadline deadline, const std::stop_token& stop) {
  if (file_->broken()) gone_with_file();
  std::vector<off_t> bytes;
  std::uint64_t target = 0;
  if (verdict.wait == WaitFor::any_holder_leave) {
    if (sweep_dead_ahead()) return;
    // The life bytes of all of them: the kernel's word on liveness, never a process id.
    for (std::size_t i = 0; i + 1 < seen_.size(); ++i) bytes.push_back(byte_offset(seen_[i], Byte::life));
  } else {
    target = seen_.at(verdict.index);
    const Byte which = verdict.wait == WaitFor::leave           ? Byte::life
                       : verdict.wait == WaitFor::exclusive_end ? Byte::exclusive
                                                                : Byte::waiting;
    bytes.push_back(byte_offset(target, which));
  }
  if (bytes.size() == 1 && !deadline && !stop.stop_possible()) {
    // Nothing else can end this wait: block in the kernel on our own description.
    set_lock(fd_.get(), F_RDLCK, bytes.front(), 1, true);
    set_lock(fd_.get(), F_UNLCK, bytes.front(), 1, false);
  } else {
    file_->wait_for_any_release(bytes, deadline, stop);
  }
  if (target != 0) {
    StateFile::Guard guard(*file_);
    file_->remove_if_dead(target);  // released by death rather than by leaving
  }
}

std::unique_ptr<BackendHold> FilePlace::hold(std::shared_ptr<LossSignal> loss) {
  // A hold is handed out only once its name is pinned in a file still at its path. Admitted in
  // a file removed or moved away meanwhile, the admission excludes nobody: leave, and the core
  // joins again, in the file now at the path.
  if (!file_->pin_if_current()) {
    leave();
    backend_.forget(file_);
    return nullptr;
  }
  auto hold = std::make_unique<FileHold>(backend_, file_, std::move(fd_), seq_, kind_, std::move(loss));
  seq_ = 0;  // the hold owns the entry now
  return hold;
}

void FilePlace::leave() noexcept { leave_slot(*file_, seq_, fd_); }

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

CounterStanding FileCounterLine::read() {
  const auto& h = file_->header();
  CounterStanding standing;
  standing.in_line = seq_ != 0;
  predecessor_ = 0;
  std::size_t i = 0;
  for (; i < h.count && h.slots[i].seq != seq_; ++i) {
    if (h.slots[i].kind != kCounterWaiter) continue;
    ++standing.ahead;
    predecessor_ = h.slots[i].seq;
  }
  if (seq_ != 0 && i == h.count) throw QueueEntryGone();
  if (h.counter_set) standing.value = h.counter;
  epoch_ = file_->counter_epoch();
  return standing;
}

// Takes the permits when first in line and the value has them, leaving the line in the same step.
bool FileCounterLine::take_if_first(const CounterStanding& standing) {
  auto& h = file_->header();
  if (evaluate_counter_line(standing.ahead, standing.value, permits_) != CounterWait::nothing) return false;
  h.counter -= permits_;
  if (seq_ != 0) remove_slot(*file_, seq_, fd_);
  return true;
}

CounterStanding FileCounterLine::look(bool last_try, Deadline) {
  StateFile::Guard guard(*file_);
  file_->check_intact();
  auto standing = read();
  if (last_try && standing.ahead > 0) {
    file_->sweep_dead();  // a dead waiter ahead would make every try fail
    standing = read();
  }
  standing.taken = take_if_first(standing);
  file_->check_intact();
  return standing;
}

bool FileCounterLine::take(const CounterStanding&, Deadline) {
  StateFile::Guard guard(*file_);
  file_->check_intact();
  const bool taken = take_if_first(read());
  file_->check_intact();
  return taken;
}

void FileCounterLine::join(Deadline) {
  fd_ = file_->checkout_descriptor();
  StateFile::Guard guard(*file_);
  file_->check_intact();
  auto& h = file_->header();
  if (h.count == kCapacity) file_->sweep_dead();
  if (h.count == kCapacity) throw_full(file_->name());
  const std::uint64_t seq = next_token(h);
  set_lock(fd_.get(), F_WRLCK, byte_offset(seq, Byte::life), 1, false);
  seq_ = seq;
  file_->append(Slot{seq, permits_, realtime_ns(), my_pid(), kCounterWaiter, 0, 0}, label_);
  file_->check_intact();
}

void FileCounterLine::wait(CounterWait wait, Deadline deadline, const std::stop_token& stop) {
  if (wait == CounterWait::value) {
    wait_for_value(deadline, stop);
  } else {
    wait_for_predecessor(deadline, stop);
  }
}

// Sleeps on the doorbell unless it rang since the last read; a sleeper is counted, so that
// adders wake the futex only when someone sleeps.
void FileCounterLine::wait_for_value(Deadline deadline, const std::stop_token& stop) {
  {
    StateFile::Guard guard(*file_);
    if (file_->counter_epoch() != epoch_) return;
    ++file_->header().counter_sleepers;
  }
  {
    std::stop_callback on_stop(stop, [&] { file_->wake_counter_waiters(); });
    futex_wait(&file_->header().counter_epoch, epoch_, deadline);
  }
  StateFile::Guard guard(*file_);
  --file_->header().counter_sleepers;
}

void FileCounterLine::wait_for_predecessor(Deadline deadline, const std::stop_token& stop) {
  const off_t byte = byte_offset(predecessor_, Byte::life);
  if (deadline || stop.stop_possible()) {
    file_->wait_for_any_release({byte}, deadline, stop);
  } else {
    set_lock(fd_.get(), F_RDLCK, byte, 1, true);
    set_lock(fd_.get(), F_UNLCK, byte, 1, false);
  }
  StateFile::Guard guard(*file_);
  file_->remove_if_dead(predecessor_);
}

bool FileCounterLine::leave() noexcept {
  leave_slot(*file_, seq_, fd_);
  return false;  // nothing of ours is ever taken without our knowing
}

// ---- the backend ---------------------------------------------------------------------------

FileBackend::~FileBackend() {
  unregister_for_fork(this);
  {
    // No join: waiting for the watcher to be scheduled just to see the stop costs a short
    // process (turnstile run) milliseconds on a busy machine. It exits on its own when it next
    // wakes, touching only the shared state; a check in progress uses our directory
    // descriptor, so that one we let finish.
    std::unique_lock lock(watch_->mutex);
    watch_->stop = true;
    watch_->cv.notify_all();
    // (Unless we are that check: a loss callback that dropped the last Client; or the watcher
    // is a parent's thread, which a forked child does not have.)
    if (watch_->thread != std::this_thread::get_id() && watch_->generation == current_generation()) {
      watch_->cv.wait(lock, [&] { return !watch_->checking; });
    }
  }
  files_.clear();
}

// Under files_mutex_.
void FileBackend::reopen_root_if_removed() {
  if (!unlinked_dir(root_fd_.get())) return;
  Fd fresh = open_root(root_);
  removed_root_fds_.push_back(std::move(root_fd_));
  root_fd_ = std::move(fresh);
  pins_ = std::make_shared<DirectoryPins>(root_fd_.get());
}

void FileBackend::adopt_after_fork_locked() {
  if (generation_ == current_generation()) return;
  // In a forked child: the parent's files and descriptors are not ours (see the fork handlers).
  files_.clear();
  removed_root_fds_.clear();
  root_fd_ = open_root(root_);
  pins_ = std::make_shared<DirectoryPins>(root_fd_.get());
  generation_ = current_generation();
}

bool FileBackend::has_state(const std::string& name) {
  std::lock_guard lock(files_mutex_);
  adopt_after_fork_locked();
  return files_.count(name) || StateFile::exists(root_fd_.get(), name);
}

std::shared_ptr<StateFile> FileBackend::file(const std::string& name) {
  std::lock_guard lock(files_mutex_);
  adopt_after_fork_locked();
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
    slot = std::make_shared<StateFile>(root_fd_.get(), pins_, name);
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

void FileBackend::forget(const std::shared_ptr<StateFile>& file) {
  std::lock_guard lock(files_mutex_);
  if (auto it = files_.find(file->name()); it != files_.end() && it->second == file) {
    files_.erase(it);
    reopen_root_if_removed();
  }
}

std::shared_ptr<StateFile> FileBackend::file_to_join(const std::string& name, bool try_once, Deadline deadline,
                                                     const std::stop_token& stop) {
  for (;;) {
    try {
      return file(name);
    } catch (const StateFileInUse&) {
      if (try_once) throw;
    }
    if (passed(deadline) || stop.stop_requested()) return nullptr;
    auto pause = SteadyClock::now() + kTruncatedFileRetry;
    if (deadline) pause = std::min(pause, *deadline);
    std::this_thread::sleep_until(pause);
  }
}

std::unique_ptr<QueuePlace> FileBackend::join(const QueueRequest& request, bool try_once, Deadline deadline,
                                              Standing& first) {
  auto file = file_to_join(request.name, try_once, deadline, request.stop);
  if (!file) return nullptr;  // the deadline passed or a stop came while a truncated file was in use
  auto place = std::make_unique<FilePlace>(*this, std::move(file), request);
  if (!place->join(request, try_once, first)) return nullptr;
  return place;
}

std::unique_ptr<CounterLine> FileBackend::counter_line(const std::string& name, std::int64_t permits,
                                            [[maybe_unused]] const std::stop_token& stop) {
  return std::make_unique<FileCounterLine>(file(name), permits, holder_label_);
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
  hold->watch_prev = nullptr;
  hold->watch_next = watch_->holds;
  if (watch_->holds) watch_->holds->watch_prev = hold;
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
  if (hold->watch_prev) {
    hold->watch_prev->watch_next = hold->watch_next;
  } else if (watch_->holds == hold) {
    watch_->holds = hold->watch_next;
  } else {
    return;  // not in the list
  }
  if (hold->watch_next) hold->watch_next->watch_prev = hold->watch_prev;
  hold->watch_prev = hold->watch_next = nullptr;
}

// The embedded backend's keep-alive: the kernel keeps our locks for as long as we live, but a
// state file removed, replaced or truncated under us (rm -rf, a tmp cleaner) no longer
// excludes anyone.
void FileBackend::watch_loop(const std::shared_ptr<WatchState>& state) {
  std::unique_lock lock(state->mutex);
  for (;;) {
    state->cv.wait_for(lock, kValidityCheckInterval, [&] { return state->stop; });
    if (state->stop) return;
    std::vector<std::pair<std::shared_ptr<StateFile>, std::shared_ptr<LossSignal>>> holds;
    for (auto* hold = state->holds; hold; hold = hold->watch_next) holds.emplace_back(hold->file(), hold->loss());
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

Inspection FileBackend::inspect(const std::string& name, Deadline) {  // local: no call to bound
  Inspection result;
  result.name = name;
  if (!has_state(name)) return result;  // looking creates nothing: no state file, nobody queued
  auto file = this->file(name);
  StateFile::Guard guard(*file);
  file->sweep_dead();
  auto& h = file->header();
  result.mode = h.mode == Mode::lock ? "lock" : h.mode == Mode::semaphore ? "semaphore" : "";
  result.limit = h.limit;
  if (h.counter_set) result.permits = h.counter;
  std::vector<QueueEntryView> views;
  for (std::size_t i = 0; i < h.count; ++i) {
    const auto& slot = h.slots[i];
    EntryInfo info;
    info.fencing_token = slot.seq;
    info.permits = slot.permits;
    info.pid = slot.pid;
    info.host = host_name();
    info.label = file->label_of(slot);
    info.since = std::chrono::system_clock::time_point(
        std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::nanoseconds(slot.since_ns)));
    if (slot.kind == kCounterWaiter) {
      info.kind = "permits";
      result.waiters.push_back(info);
      continue;
    }
    info.kind = to_string(static_cast<EntryKind>(slot.kind));
    views.push_back({static_cast<EntryKind>(slot.kind), slot.permits});
    info.holding = evaluate_queue(views, views.size() - 1, h.limit).admitted();
    (info.holding ? result.holders : result.waiters).push_back(info);
  }
  file->check_intact();
  return result;
}

bool FileBackend::counter_try_set(const std::string& name, std::int64_t permits) {
  auto file = this->file(name);
  StateFile::Guard guard(*file);
  auto& h = file->header();
  if (h.counter_set) {
    file->check_intact();
    return false;
  }
  h.counter = permits;
  h.counter_set = 1;
  file->ring_counter();
  file->check_intact();
  return true;
}

std::int64_t FileBackend::counter_add(const std::string& name, std::int64_t delta) {
  auto file = this->file(name);
  StateFile::Guard guard(*file);
  auto& h = file->header();
  const std::int64_t current = h.counter_set ? h.counter : 0;
  std::int64_t updated;
  if (__builtin_add_overflow(current, delta, &updated) || updated > max_permits || updated < -max_permits) {
    throw InvalidArgument("PermitCounter '" + name + "': adding " + std::to_string(delta) + " to " +
                          std::to_string(current) + " would leave the count outside -" + std::to_string(max_permits) +
                          ".." + std::to_string(max_permits) + "; nothing changed");
  }
  h.counter = updated;
  h.counter_set = 1;
  if (delta > 0) file->ring_counter();
  file->check_intact();
  return updated;
}

std::optional<std::int64_t> FileBackend::counter_get(const std::string& name) {
  auto file = this->file(name);
  StateFile::Guard guard(*file);
  auto& h = file->header();
  std::optional<std::int64_t> value;
  if (h.counter_set) value = h.counter;
  file->check_intact();
  return value;
}

std::int64_t FileBackend::counter_drain(const std::string& name) {
  auto file = this->file(name);
  StateFile::Guard guard(*file);
  auto& h = file->header();
  if (!h.counter_set) return 0;
  const auto drained = h.counter;
  h.counter = 0;
  file->check_intact();
  return drained;
}

}  // namespace

std::unique_ptr<Backend> make_file_backend(const BackendUrl& url, const ClientOptions& options) {
  std::string root = file_state::root_of(url);
  file_state::Fd fd = file_state::open_root(root);
  return std::make_unique<FileBackend>(std::move(root), std::move(fd), options.holder_label);
}

}  // namespace turnstile::detail
