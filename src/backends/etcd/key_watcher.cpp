// SPDX-License-Identifier: Apache-2.0
#include "backends/etcd/key_watcher.hpp"

#include <algorithm>
#include <optional>

#include "backends/etcd/layout.hpp"
#include "backends/etcd/timeouts.hpp"

namespace turnstile::detail::etcd {

KeyWatcher::KeyWatcher(Connection& connection, std::function<void()> lost)
    : connection_(connection), lost_(std::move(lost)), reader_([this](std::stop_token stop) { read_loop(stop); }),
      worker_([this](std::stop_token stop) { work_loop(stop); }) {}

void KeyWatcher::stop() {
  reader_.request_stop();
  worker_.request_stop();
  if (reader_.joinable()) reader_.join();
  if (worker_.joinable()) worker_.join();
}

std::shared_ptr<KeyWatcher::Watched> KeyWatcher::watch(std::string key, std::int64_t create_revision,
                                                       std::int64_t lease, std::string value,
                                                       std::int64_t seen_revision, std::shared_ptr<LossSignal> loss,
                                                       std::string side_key) {
  auto watched = std::make_shared<Watched>();
  watched->key = std::move(key);
  watched->side_key = std::move(side_key);
  watched->create_revision = create_revision;
  watched->lease = lease;
  watched->loss = std::move(loss);
  watched->values.push_back(std::move(value));
  watched->from_revision = std::max(seen_revision, create_revision) + 1;
  watched->not_before = SteadyClock::now() + kFirstKeyWatchDelay;
  bool wake = false;
  {
    std::lock_guard lock(mutex_);
    watched_.insert(watched);
    if (stream_) creates_.push_back(watched);
    // A worker already waiting for an earlier create's time comes to this one by itself:
    // back-to-back short holds cost no wake-up each.
    wake = !stream_ || !worker_timed_;
  }
  if (wake) cv_.notify_all();
  return watched;
}

void KeyWatcher::allow(Watched& watched, std::string value) {
  std::lock_guard lock(mutex_);
  watched.values.push_back(std::move(value));
}

void KeyWatcher::unwatch(const std::shared_ptr<Watched>& watched) {
  std::unique_lock lock(mutex_);
  if (watched->done || !unwatch_locked(watched)) return;
  const auto ticket = cancels_queued_;
  cv_.notify_all();  // a cancel to send
  // Written before the caller's own delete goes out, so that etcd has cancelled the watch when
  // the delete commits and sends its event to nobody (one release, one event sent: the wake-up
  // counts saw two when the delete overtook the cancel). Bounded; never a round trip.
  cv_.wait_for(lock, kCancelWriteWait, [&] { return cancels_written_ >= ticket || !stream_; });
}

void KeyWatcher::queue_cancel_locked(std::int64_t watch_id) {
  cancels_.push_back(watch_id);
  ++cancels_queued_;
}

std::shared_ptr<KeyWatcher::Watched> KeyWatcher::arm(const pb::WatchCreateRequest& watch, std::int64_t lease, Wake wake,
                                                     WakeAfter after) {
  auto armed = arm_unwatched(std::move(wake));
  armed->key = watch.key();
  armed->range_end = watch.range_end();
  armed->deletes_only = !watch.filters().empty();
  armed->lease = lease;
  armed->from_revision = watch.start_revision();
  armed->events_to_wake = std::max<std::int64_t>(after.events, 1);
  armed->own_key = std::move(after.own_key);
  {
    std::lock_guard lock(mutex_);
    watched_.insert(armed);
    if (stream_) queue_waiter_create_locked(armed);
  }
  cv_.notify_all();
  return armed;
}

void KeyWatcher::queue_waiter_create_locked(std::shared_ptr<Watched> armed) {
  // Sent at once: before the holds' creates still waiting for their time (at the back).
  const auto later = std::find_if(creates_.rbegin(), creates_.rend(), [&](const std::shared_ptr<Watched>& queued) {
    return queued->not_before <= armed->not_before;
  });
  creates_.insert(later.base(), std::move(armed));
}

std::shared_ptr<KeyWatcher::Watched> KeyWatcher::arm_unwatched(Wake wake) {
  auto armed = std::make_shared<Watched>();
  armed->wake = std::move(wake);
  return armed;
}

void KeyWatcher::fire(const std::shared_ptr<Watched>& armed) {
  std::lock_guard lock(mutex_);
  wake_locked(armed);
}

void KeyWatcher::wake_lease(std::int64_t lease) {
  std::lock_guard lock(mutex_);
  wake_armed_locked([lease](const Watched& armed) { return armed.lease == lease; });
}

void KeyWatcher::disarm(const std::shared_ptr<Watched>& armed) {
  Lock lock(mutex_);
  armed->disarmed = true;
  if (!armed->done && unwatch_locked(armed)) cv_.notify_all();  // a cancel to send
  cv_.wait(lock, [&] { return !armed->waking; });
}

void KeyWatcher::wake_locked(const std::shared_ptr<Watched>& armed) {
  if (armed->done) return;
  unwatch_locked(armed);
  wakes_.push_back(armed);
  cv_.notify_all();
}

void KeyWatcher::wake_armed_locked(const std::function<bool(const Watched&)>& which) {
  std::vector<std::shared_ptr<Watched>> armed;
  for (const auto& watched : watched_) {
    if (watched->wake && which(*watched)) armed.push_back(watched);
  }
  for (const auto& each : armed) wake_locked(each);
}

bool KeyWatcher::allowed(const Watched& watched, const mvccpb::KeyValue& kv) const {
  return kv.create_revision() == watched.create_revision && kv.lease() == watched.lease &&
         std::find(watched.values.begin(), watched.values.end(), kv.value()) != watched.values.end();
}

bool KeyWatcher::unwatch_locked(const std::shared_ptr<Watched>& watched) {
  watched->done = true;
  watched_.erase(watched);
  if (watched->watch_id < 0) return false;
  by_id_.erase(watched->watch_id);
  if (stream_) queue_cancel_locked(watched->watch_id);
  return stream_ != nullptr;
}

void KeyWatcher::lose_locked(const std::shared_ptr<Watched>& watched, std::string reason) {
  unwatch_locked(watched);
  losses_.emplace_back(watched, std::move(reason));
  cv_.notify_all();
}

// --- the reader ----------------------------------------------------------------------------

void KeyWatcher::read_loop(std::stop_token stop) {
  while (!stop.stop_requested()) {
    {
      std::unique_lock lock(mutex_);
      if (!cv_.wait(lock, stop, [&] { return !watched_.empty(); })) return;
    }
    const auto opened = SteadyClock::now();
    try {
      const auto status = run_stream(stop);
      // An expired auth token is renewed here, outside the stream's GrpcScope.
      if (!status.ok() && !stop.stop_requested()) {
        connection_.check_retryable(status, "a watch", SteadyClock::now() + kBackgroundTry);
      }
    } catch (...) {
      // Refused, or the client ended at exit: tried again below unless stopped.
    }
    // A stream that ended at once (etcd down or restarting, a fork) is not reopened in a loop.
    if (SteadyClock::now() - opened < kKeyWatchShortLife) {
      std::unique_lock lock(mutex_);
      cv_.wait_for(lock, stop, kWatchRetryPause, [] { return false; });
    }
  }
}

grpc::Status KeyWatcher::run_stream(const std::stop_token& stop) {
  grpc::ClientContext context;
  // Bounded, so that no watch depends on one connection forever.
  connection_.prepare(context, SteadyClock::now() + kKeyWatchLife);
  GrpcScope scope(&context);
  std::stop_callback cancel(stop, [&context] { context.TryCancel(); });
  auto stream = connection_.key_watch_stub().Watch(&context);
  {
    // Every key and waiter watched again, once, each from the first revision it has not seen.
    std::lock_guard lock(mutex_);
    stream_ = stream.get();
    in_flight_.clear();
    by_id_.clear();
    cancels_.clear();
    cancels_written_ = cancels_queued_;  // a new stream has none of the old watches
    creates_.clear();
    for (const auto& watched : watched_) {
      watched->watch_id = -1;
      creates_.push_back(watched);
    }
  }
  cv_.notify_all();
  pb::WatchResponse response;
  while (stream->Read(&response)) handle(response);
  context.TryCancel();
  {
    // The waiters stay armed: the next stream watches again from where each had come to, so a
    // renewal (every kKeyWatchLife) wakes nobody. A waiter whose lease went is woken by
    // wake_lease; one whose watch etcd cannot resume (compacted) by its cancel.
    std::unique_lock lock(mutex_);
    stream_ = nullptr;
    cv_.wait(lock, [&] { return !writing_; });  // Finish must not overlap a Write
  }
  return stream->Finish();
}

void KeyWatcher::handle_created(const pb::WatchResponse& response) {
  // etcd answers a stream's create requests in order.
  if (in_flight_.empty()) return;
  auto watched = std::move(in_flight_.front());
  in_flight_.pop_front();
  if (response.canceled()) {
    if (watched->done) return;
    if (watched->wake) return wake_locked(watched);  // its start revision was compacted
    rechecks_.push_back(watched);
  } else if (watched->done) {
    queue_cancel_locked(response.watch_id());
  } else {
    watched->watch_id = response.watch_id();
    by_id_[response.watch_id()] = watched;
    // A waiter's watch from now starts after the revision etcd created it at: a later stream
    // watches again from there, never from a new "now" (which would miss what came between).
    if (watched->from_revision == 0) watched->from_revision = response.header().revision() + 1;
    return;
  }
  cv_.notify_all();  // work for the worker
}

bool KeyWatcher::waiter_event(Watched& armed, const pb::WatchResponse& response) {
  bool wake = false;
  for (const auto& event : response.events()) {
    if (event.kv().mod_revision() < armed.from_revision) continue;  // counted already
    if (!armed.own_key.empty() && event.kv().key() == armed.own_key) wake = true;
    --armed.events_to_wake;
  }
  // The cursor moves past the revisions the watch brought (etcd sends a revision's events
  // together), so that the watch made again on a new stream counts nothing twice.
  if (!response.events().empty()) {
    const auto next = response.events(response.events_size() - 1).kv().mod_revision() + 1;
    armed.from_revision = std::max(armed.from_revision, next);
  }
  return wake || armed.events_to_wake <= 0;
}

void KeyWatcher::handle(const pb::WatchResponse& response) {
  std::lock_guard lock(mutex_);
  if (response.created()) return handle_created(response);
  const auto found = by_id_.find(response.watch_id());
  if (found == by_id_.end()) return;
  const auto watched = found->second;
  if (watched->wake) {
    // Enough events of a waiter's watch, or the watch's end (compacted): the next look decides.
    if (response.canceled() || response.compact_revision() != 0 || waiter_event(*watched, response)) {
      wake_locked(watched);
    }
    return;
  }
  for (const auto& event : response.events()) {
    if (event.kv().key() != watched->key) continue;
    watched->from_revision = std::max(watched->from_revision, event.kv().mod_revision() + 1);
    if (event.type() == mvccpb::Event::DELETE) {
      return lose_locked(watched, "its etcd key was deleted (by hand, or with its lease, revoked or expired)");
    }
    if (!allowed(*watched, event.kv())) {
      return lose_locked(watched, "its etcd key was overwritten by another writer");
    }
  }
  if (response.canceled() || response.compact_revision() != 0) {
    // Events may have been compacted away: the key is read again before a new watch.
    by_id_.erase(found);
    watched->watch_id = -1;
    rechecks_.push_back(watched);
    cv_.notify_all();
  }
}

// --- the worker ----------------------------------------------------------------------------

void KeyWatcher::work_loop(std::stop_token stop) {
  Lock lock(mutex_);
  while (wait_for_work(lock, stop)) {
    if (!wakes_.empty()) {
      run_wake(lock);
    } else if (!losses_.empty()) {
      tell_loss(lock);
    } else if (stream_ && (!creates_.empty() || !cancels_.empty())) {
      send_request(lock);
    } else {
      recheck(lock);
    }
  }
}

bool KeyWatcher::other_work() const {
  return !wakes_.empty() || !losses_.empty() || !rechecks_.empty() || (stream_ && !cancels_.empty());
}

bool KeyWatcher::wait_for_work(Lock& lock, const std::stop_token& stop) {
  for (;;) {
    if (stop.stop_requested()) return false;
    while (!creates_.empty() && creates_.front()->done) creates_.pop_front();
    if (other_work()) return true;
    // Creates are queued in the order of their delays (a new stream queues past ones first).
    if (!stream_ || creates_.empty()) {
      cv_.wait(lock, stop, [&] { return other_work() || (stream_ && !creates_.empty()); });
      continue;
    }
    const auto due = creates_.front()->not_before;
    if (due <= SteadyClock::now()) return true;
    worker_timed_ = true;
    cv_.wait_until(lock, stop, due, [&] { return other_work(); });
    worker_timed_ = false;
  }
}

void KeyWatcher::tell_loss(Lock& lock) {
  auto [watched, reason] = std::move(losses_.front());
  losses_.pop_front();
  lock.unlock();
  watched->loss->lose(reason, LossCause::entry_gone);
  lost_();
  if (!watched->side_key.empty()) remove_side_key(*watched);
  lock.lock();
}

// Only the side key created with our entry (its create revision): best effort, as it also ends
// with our lease.
void KeyWatcher::remove_side_key(const Watched& watched) {
  pb::TxnRequest txn;
  add_compare(txn, watched.side_key, pb::Compare::CREATE, watched.create_revision);
  add_delete(txn.mutable_success(), watched.side_key);
  try {
    connection_.txn(txn, CallBudget(SteadyClock::now() + kBackgroundTry), Resend::allowed);
  } catch (const Error&) {
    // Not removed now: it goes with the lease.
  }
}

void KeyWatcher::run_wake(Lock& lock) {
  const auto armed = std::move(wakes_.front());
  wakes_.pop_front();
  if (armed->disarmed) return;
  armed->waking = true;
  lock.unlock();
  armed->wake();  // posts the waiter's next step: it does not block
  lock.lock();
  armed->waking = false;
  cv_.notify_all();  // a disarm waiting for it
}

void KeyWatcher::send_request(Lock& lock) {
  pb::WatchRequest request;
  const bool cancel = !cancels_.empty();
  if (cancel) {
    request.mutable_cancel_request()->set_watch_id(cancels_.front());
    cancels_.pop_front();
  } else {
    auto watched = std::move(creates_.front());
    creates_.pop_front();
    if (watched->done) return;
    auto* create = request.mutable_create_request();
    create->set_key(watched->key);
    create->set_start_revision(watched->from_revision);  // a waiter's 0: from now
    create->set_range_end(watched->range_end);
    if (watched->deletes_only) create->add_filters(pb::WatchCreateRequest::NOPUT);
    in_flight_.push_back(std::move(watched));  // before the answer can come
  }
  // The reader's scope covers the stream; a failed write means it is ending, and the next
  // stream watches every key again.
  auto* stream = stream_;
  writing_ = true;
  lock.unlock();
  stream->Write(request);
  lock.lock();
  writing_ = false;
  if (cancel) ++cancels_written_;
  cv_.notify_all();
}

void KeyWatcher::recheck(Lock& lock) {
  auto watched = std::move(rechecks_.front());
  rechecks_.pop_front();
  if (watched->done) return;
  lock.unlock();
  std::optional<pb::RangeResponse> now;
  try {
    pb::RangeRequest read;
    read.set_key(watched->key);
    now = connection_.range(read, CallBudget(SteadyClock::now() + kBackgroundTry));
  } catch (...) {
    // Not read: watched again from where it was; etcd cancels it again if need be.
  }
  lock.lock();
  if (watched->done) return;
  if (now && (now->kvs_size() == 0 || !allowed(*watched, now->kvs(0)))) {
    return lose_locked(watched, now->kvs_size() == 0 ? "its etcd key was deleted (by hand, or with its lease)"
                                                     : "its etcd key was overwritten by another writer");
  }
  if (now) watched->from_revision = std::max(watched->from_revision, now->header().revision() + 1);
  if (stream_) creates_.push_back(watched);  // otherwise the next stream watches it
}

}  // namespace turnstile::detail::etcd
