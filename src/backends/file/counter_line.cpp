// SPDX-License-Identifier: Apache-2.0
// PermitCounter on a state file: its line of waiters and its plain operations.
#include "backends/file/file_backend.hpp"

#include <fcntl.h>

#include "backends/file/entry_slot.hpp"
#include "turnstile/permit_counter.hpp"

namespace turnstile::detail {

using namespace file_state;

namespace {

// A PermitCounter's count lives in its state file, and a file removed as unused kept none: a
// change made in one removed since we opened it would be seen by nobody, and a waiter there
// would sleep on a doorbell nobody rings. So, under the guard, a counter operation checks the
// file's removal mark (a file not marked stays in place until the guard ends, and one with a
// value or a waiter is never removed) and looks again in the file now at the path otherwise:
// the backend reopens it (file() sees the mark).

void check_not_removed(StateFile& file) {
  if (file.removed_as_unused()) throw QueueEntryGone();
}

}  // namespace

// Runs `operation` on the name's state file under its guard, in a file still linked.
template <class Operation>
auto FileBackend::with_linked_file(const std::string& name, Operation operation) {
  for (int attempt = 0;; ++attempt) {
    auto file = this->file(name);
    StateFile::Guard guard(*file);
    if (!file->removed_as_unused()) return operation(*file);
    if (attempt == kRemovedRetries) throw_keeps_being_removed(name);
  }
}

CounterStanding FileCounterLine::read() {
  const auto& h = file_->header();
  CounterStanding standing;
  standing.in_line = seq_ != 0;
  predecessor_ = 0;
  const std::size_t n = file_->count();
  std::size_t i = 0;
  for (; i < n && file_->slot(i).seq != seq_; ++i) {
    if (file_->slot(i).kind != kCounterWaiter) continue;
    ++standing.ahead;
    predecessor_ = file_->slot(i).seq;
  }
  if (seq_ != 0 && i == n) throw QueueEntryGone();
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
  if (seq_ == 0) check_not_removed(*file_);  // in line, our entry keeps it
  if (std::exchange(check_predecessor_, false)) file_->remove_if_dead(predecessor_);
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
  if (seq_ == 0) check_not_removed(*file_);
  const bool taken = take_if_first(read());
  file_->check_intact();
  return taken;
}

void FileCounterLine::join(Deadline) {
  fd_ = EntryFd(file_->checkout_descriptor());
  StateFile::Guard guard(*file_);
  file_->check_intact();
  check_not_removed(*file_);
  auto& h = file_->header();
  if (file_->full()) file_->sweep_dead();
  if (file_->full()) throw_full(file_->name());
  file_->share_description(fd_);  // a waiter: no descriptor of its own (EntryFd)
  seq_ = next_token(h);
  set_lock(fd_.get(), F_WRLCK, byte_offset(seq_, Byte::life), 1, false);
  file_->append(new_slot(seq_, permits_, kCounterWaiter), label_);
  file_->local_entries().added(seq_, byte_bit(Byte::life));
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
    file_->sleep_until_free(byte);
  }
  StateFile::Guard guard(*file_);
  file_->remove_if_dead(predecessor_);
}

// wait() without a thread: the predecessor's release, told by it when it is this client's own
// entry, by a shared watcher thread otherwise (local_entries.hpp). The first in line sleeps on
// the futex word on a thread of its own (one per name: the others wait on their predecessors).
std::unique_ptr<WakeArm> FileCounterLine::arm(CounterWait wait, Deadline deadline, Wake wake) {
  if (wait == CounterWait::value) return CounterLine::arm(wait, deadline, std::move(wake));
  check_predecessor_ = true;  // a dead predecessor's byte is free: the next look removes it
  return arm_for_release(file_, {predecessor_}, Byte::life, std::move(wake));
}

bool FileCounterLine::leave() noexcept {
  leave_slot(*file_, seq_, fd_);
  return false;  // nothing of ours is ever taken without our knowing
}

bool FileBackend::counter_try_set(const std::string& name, std::int64_t permits) {
  return with_linked_file(name, [&](StateFile& file) {
    auto& h = file.header();
    if (h.counter_set) {
      file.check_intact();
      return false;
    }
    h.counter = permits;
    h.counter_set = 1;
    file.ring_counter();
    file.check_intact();
    return true;
  });
}

std::int64_t FileBackend::counter_add(const std::string& name, std::int64_t delta) {
  return with_linked_file(name, [&](StateFile& file) {
    auto& h = file.header();
    const std::int64_t current = h.counter_set ? h.counter : 0;
    std::int64_t updated;
    if (__builtin_add_overflow(current, delta, &updated) || updated > max_permits || updated < -max_permits) {
      throw InvalidArgument("PermitCounter '" + name + "': adding " + std::to_string(delta) + " to " +
                            std::to_string(current) + " would leave the count outside -" + std::to_string(max_permits) +
                            ".." + std::to_string(max_permits) + "; nothing changed");
    }
    h.counter = updated;
    h.counter_set = 1;
    if (delta > 0) file.ring_counter();
    file.check_intact();
    return updated;
  });
}

std::optional<std::int64_t> FileBackend::counter_get(const std::string& name) {
  return with_linked_file(name, [&](StateFile& file) {
    auto& h = file.header();
    std::optional<std::int64_t> value;
    if (h.counter_set) value = h.counter;
    file.check_intact();
    return value;
  });
}

std::int64_t FileBackend::counter_drain(const std::string& name) {
  return with_linked_file(name, [&](StateFile& file) -> std::int64_t {
    auto& h = file.header();
    if (!h.counter_set) return 0;
    const auto drained = h.counter;
    h.counter = 0;
    file.check_intact();
    return drained;
  });
}

}  // namespace turnstile::detail
