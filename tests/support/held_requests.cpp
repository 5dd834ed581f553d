// SPDX-License-Identifier: Apache-2.0
#include "support/held_requests.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <stdexcept>
#include <utility>

namespace turnstile_test {
namespace detail {
namespace {

// Bytes of a connection's past kept to match patterns that span chunks (longer patterns match
// within a chunk only).
constexpr std::size_t tail_limit = 4096;

// True when `pattern` occurs in `text` (a connection's tail, then its new chunk) ending inside
// the new chunk: a match lying wholly in the tail was counted with its own chunk.
bool matches_new(const std::string& text, std::size_t tail_size, const std::string& pattern) {
  const std::size_t overlap = pattern.size() - 1;
  const std::size_t from = tail_size > overlap ? tail_size - overlap : 0;
  return text.find(pattern, from) != std::string::npos;
}

template <typename Record>
void erase_record(std::vector<std::shared_ptr<Record>>& records, const Record* record) {
  std::erase_if(records, [&](const auto& r) { return r.get() == record; });
}

}  // namespace

void ProxyControl::request(std::unique_lock<std::mutex>& lock) {
  if (stopped) return;  // the thread is gone, and with it its eventfd
  const auto mine = ++requested;
  const std::uint64_t one = 1;
  if (::write(wake, &one, sizeof one) < 0 && errno != EAGAIN) {
    // eventfd writes cannot fail short of overflow; the wait below would then hang.
    throw std::runtime_error("TcpProxy: cannot wake its thread");
  }
  seen.wait(lock, [&] { return observed >= mine || stopped; });
}

bool ProxyControl::on_request_chunk(RequestWatch& watch, std::string_view chunk) {
  std::string text = watch.tail;
  text.append(chunk);
  const auto tail_size = watch.tail.size();
  bool changed = false;
  for (auto it = armed.begin(); it != armed.end();) {
    HoldRecord& hold = **it;
    if (matches_new(text, tail_size, hold.pattern) && ++hold.seen == hold.nth) {
      hold.phase = HoldRecord::Phase::held;
      hold.connection = watch.id;
      watch.holds.push_back(*it);
      it = armed.erase(it);
      changed = true;
    } else {
      ++it;
    }
  }
  for (auto it = copies.begin(); it != copies.end();) {
    CopyRecord& copy = **it;
    if (matches_new(text, tail_size, copy.pattern) && ++copy.seen == copy.nth) {
      copy.captured = true;
      copy.bytes.assign(chunk);
      it = copies.erase(it);
      changed = true;
    } else {
      ++it;
    }
  }
  const bool keep = watch.keeps();
  for (const auto& later : laters) {
    if (keep || later->forwarded || later->not_on == watch.id || !matches_new(text, tail_size, later->pattern))
      continue;
    later->forwarded = true;
    watch.awaiting_reply = later;
  }
  watch.tail = text.substr(text.size() - std::min(text.size(), tail_limit));
  if (changed) seen.notify_all();
  return keep;
}

void ProxyControl::on_reply(RequestWatch& watch) {
  if (!watch.awaiting_reply) return;
  watch.awaiting_reply->answered = true;
  watch.awaiting_reply.reset();
  seen.notify_all();
}

Settle ProxyControl::settle(RequestWatch& watch) {
  using Phase = HoldRecord::Phase;
  if (watch.holds.empty()) return Settle::nothing;
  bool cut = false;
  for (auto& hold : watch.holds) cut = std::exchange(hold->cut_requested, false) || cut;
  if (cut) return Settle::cut_client;  // the caller asks again for a deliver or drop
  const auto asked = [&](Phase phase) {
    return std::any_of(watch.holds.begin(), watch.holds.end(), [&](const auto& h) { return h->phase == phase; });
  };
  if (asked(Phase::drop_requested)) {
    for (auto& hold : watch.holds) hold->phase = Phase::dropped;
  } else if (std::all_of(watch.holds.begin(), watch.holds.end(),
                         [](const auto& h) { return h->phase == Phase::deliver_requested; })) {
    for (auto& hold : watch.holds) hold->phase = Phase::delivered;
  } else {
    return Settle::nothing;
  }
  const bool dropped = watch.holds.front()->phase == Phase::dropped;
  watch.holds.clear();
  seen.notify_all();
  return dropped ? Settle::drop : Settle::deliver;
}

}  // namespace detail

namespace {
using Phase = detail::HoldRecord::Phase;
bool was_held(Phase phase) { return phase != Phase::armed && phase != Phase::disarmed; }
}  // namespace

bool HeldRequest::wait_held(std::chrono::milliseconds timeout) {
  std::unique_lock lock(control_->mutex);
  control_->seen.wait_for(lock, timeout, [&] { return record_->phase != Phase::armed || control_->stopped; });
  return was_held(record_->phase);
}

bool HeldRequest::held() const {
  std::lock_guard lock(control_->mutex);
  return was_held(record_->phase);
}

bool HeldRequest::disarm() {
  if (record_->phase != Phase::armed) return false;
  record_->phase = Phase::disarmed;
  detail::erase_record(control_->armed, record_.get());
  return true;
}

void HeldRequest::deliver() {
  std::unique_lock lock(control_->mutex);
  if (disarm() || record_->phase != Phase::held) return;
  record_->phase = Phase::deliver_requested;
  control_->request(lock);
}

bool HeldRequest::deliver_after(const std::string& later_pattern, std::chrono::milliseconds timeout) {
  if (later_pattern.empty()) throw std::invalid_argument("HeldRequest::deliver_after: empty pattern");
  auto later = std::make_shared<detail::LaterRecord>();
  later->pattern = later_pattern;
  {
    std::unique_lock lock(control_->mutex);
    later->not_on = record_->connection;
    control_->laters.push_back(later);
    control_->seen.wait_for(lock, timeout, [&] { return later->answered || control_->stopped; });
    detail::erase_record(control_->laters, later.get());
    if (!later->answered) return false;
  }
  deliver();
  return true;
}

void HeldRequest::drop() {
  std::unique_lock lock(control_->mutex);
  if (disarm() || (record_->phase != Phase::held && record_->phase != Phase::deliver_requested)) return;
  record_->phase = Phase::drop_requested;
  control_->request(lock);
}

void HeldRequest::cut_client() {
  std::unique_lock lock(control_->mutex);
  if (record_->phase != Phase::held) return;
  record_->cut_requested = true;
  control_->request(lock);
}

bool DuplicatedRequest::wait_seen(std::chrono::milliseconds timeout) {
  std::unique_lock lock(control_->mutex);
  return control_->seen.wait_for(lock, timeout, [&] { return record_->captured || control_->stopped; }) &&
         record_->captured;
}

void DuplicatedRequest::replay() {
  std::unique_lock lock(control_->mutex);
  if (!record_->captured) throw std::logic_error("DuplicatedRequest::replay: the request was not seen yet");
  const auto mine = ++record_->replays_requested;
  const auto failed_before = record_->replays_failed;
  control_->replays.push_back(record_);
  control_->request(lock);
  const bool ended = control_->seen.wait_for(lock, std::chrono::seconds(5), [&] {
    return record_->replays_written + record_->replays_failed >= mine || control_->stopped;
  });
  if (!ended || record_->replays_failed != failed_before || control_->stopped)
    throw std::runtime_error("DuplicatedRequest::replay: the copy could not be written");
}

}  // namespace turnstile_test
