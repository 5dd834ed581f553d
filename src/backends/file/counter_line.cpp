// PermitCounter on a state file: its line of waiters and its plain operations.
#include "backends/file/file_backend.hpp"

#include <fcntl.h>

#include "backends/file/entry_slot.hpp"
#include "turnstile/permit_counter.hpp"

namespace turnstile::detail {

using namespace file_state;

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
  file_->append(new_slot(seq, permits_, kCounterWaiter), label_);
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

}  // namespace turnstile::detail
