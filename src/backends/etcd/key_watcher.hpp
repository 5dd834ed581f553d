// SPDX-License-Identifier: Apache-2.0
// Watches the key of every hold on one Watch stream of its own. Keep-alives prove only that
// the lease lives; a key deleted by hand (`etcdctl del`), with its lease (`etcdctl lease
// revoke`), or overwritten by another writer means the hold is gone, and its holder is told at
// once. Two threads: the reader owns the stream and reads it; the worker writes watch requests,
// re-reads keys whose watch etcd cancelled (a compacted start revision) and tells the losses,
// so that no user callback runs while the stream is open (fork handling counts it as a call).
// The same stream carries the waiters' wake-ups (QueuePlace::arm, CounterLine::arm): a watch
// each, on this one stream, and the worker runs the wake, so that async waiters cost no thread.
// A waiter's one watch starts at the revision after its look: etcd serves it at once when the
// store has not moved since, and otherwise sends what it missed by its catch-up (every 100 ms)
// before going on live. A stream's end (its renewal, a broken connection) re-creates each watch
// once, from the first revision it has not brought yet: no event is missed or counted twice.
#pragma once

#include <condition_variable>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "backends/etcd/connection.hpp"
#include "core/loss_signal.hpp"
#include "core/queue_store.hpp"

namespace turnstile::detail::etcd {

// When an armed waiter wakes (KeyWatcher::arm), or a blocking wait returns.
struct WakeAfter {
  std::int64_t events = 1;  // the watch's events (a Semaphore waiter: the entries ahead that must leave)
  std::string own_key;      // an event of this key wakes at once (our own entry went)
};

class KeyWatcher {
 public:
  struct Watched {
    std::string key;
    std::int64_t create_revision = 0;
    std::int64_t lease = 0;
    std::shared_ptr<LossSignal> loss;
    std::string side_key;  // an election candidate's (same create revision): removed on a loss
    // Guarded by the watcher's mutex:
    std::vector<std::string> values;     // the values this client wrote to the key
    std::int64_t from_revision = 0;      // the first revision not yet seen (a waiter's 0: from now)
    std::int64_t watch_id = -1;          // on the current stream, once etcd created the watch
    bool done = false;                   // released or lost: no longer watched
    SteadyClock::time_point not_before;  // its first watch request is sent then
    // A waiter's wake-up (arm()) instead of a hold's key: run once, on the worker.
    Wake wake;
    std::string range_end;      // the watch's, for a prefix
    bool deletes_only = false;  // the watch filters puts out
    bool disarmed = false;      // guarded: the wake must not run any more
    bool waking = false;        // guarded: the wake runs now
    // Guarded. The wake runs after this many events, or at once on an event of `own_key`.
    std::int64_t events_to_wake = 1;
    std::string own_key;
  };

  // `lost` runs (on the worker thread) after a hold was told that its key went.
  KeyWatcher(Connection& connection, std::function<void()> lost);
  ~KeyWatcher() { stop(); }

  void stop();

  // From `seen_revision` + 1 on: the key was read as ours at `seen_revision`. A candidate's
  // `side_key` is deleted when the key's loss is found (it would outlive it on our lease).
  std::shared_ptr<Watched> watch(std::string key, std::int64_t create_revision, std::int64_t lease, std::string value,
                                 std::int64_t seen_revision, std::shared_ptr<LossSignal> loss,
                                 std::string side_key = {});
  // Before this client writes `value` to the key itself (a downgrade).
  void allow(Watched& watched, std::string value);
  // Before this client deletes the key itself (a release).
  void unwatch(const std::shared_ptr<Watched>& watched);

  // A waiter's one-shot wake-up, never run inside this call: `wake` runs on the worker after the
  // events `after` names of `watch` (from its start revision; 0: from when etcd creates it), etcd
  // cancelling it (a compacted start revision), or wake_lease(`lease`). The next look decides.
  std::shared_ptr<Watched> arm(const pb::WatchCreateRequest& watch, std::int64_t lease, Wake wake,
                               WakeAfter after = {});
  // A wake-up with no watch: only fire() runs it.
  std::shared_ptr<Watched> arm_unwatched(Wake wake);
  // Runs an armed wake-up on the worker, unless it ran already or was disarmed.
  void fire(const std::shared_ptr<Watched>& armed);
  // Runs every wake-up armed on `lease` (lost: its waiters join again on a new lease).
  void wake_lease(std::int64_t lease);
  // Once it returns, the wake-up neither runs nor will run (a running one is waited for).
  void disarm(const std::shared_ptr<Watched>& armed);

 private:
  using Lock = std::unique_lock<std::mutex>;

  bool allowed(const Watched& watched, const mvccpb::KeyValue& kv) const;
  // With the mutex held: no longer watched, its watch cancelled; true when a cancel is queued.
  bool unwatch_locked(const std::shared_ptr<Watched>& watched);
  void queue_cancel_locked(std::int64_t watch_id);
  // With the mutex held: the hold is told by the worker.
  void lose_locked(const std::shared_ptr<Watched>& watched, std::string reason);
  // With the mutex held: an armed wake-up is no longer watched, and queued for the worker.
  void wake_locked(const std::shared_ptr<Watched>& armed);
  void wake_armed_locked(const std::function<bool(const Watched&)>& which);
  // With the mutex held: a waiter's create, sent before the holds' delayed ones.
  void queue_waiter_create_locked(std::shared_ptr<Watched> armed);

  void read_loop(std::stop_token stop);
  grpc::Status run_stream(const std::stop_token& stop);
  void handle(const pb::WatchResponse& response);
  void handle_created(const pb::WatchResponse& response);
  // With the mutex held: a waiter's events, counted once each; true when it is to wake.
  static bool waiter_event(Watched& armed, const pb::WatchResponse& response);

  void work_loop(std::stop_token stop);
  // Waits until the worker has something to do now; false when stopped.
  bool wait_for_work(Lock& lock, const std::stop_token& stop);
  bool other_work() const;
  void tell_loss(Lock& lock);
  void remove_side_key(const Watched& watched);
  void run_wake(Lock& lock);
  void send_request(Lock& lock);
  void recheck(Lock& lock);

  Connection& connection_;
  std::function<void()> lost_;
  std::mutex mutex_;
  std::condition_variable_any cv_;
  std::set<std::shared_ptr<Watched>> watched_;
  grpc::ClientReaderWriter<pb::WatchRequest, pb::WatchResponse>* stream_ = nullptr;  // the current one
  bool writing_ = false;
  bool worker_timed_ = false;                      // the worker waits for the first queued create's time
  std::list<std::shared_ptr<Watched>> creates_;    // to send on the current stream
  std::list<std::shared_ptr<Watched>> in_flight_;  // sent, not yet answered `created`
  std::list<std::int64_t> cancels_;
  std::uint64_t cancels_queued_ = 0;   // cancels ever queued on this watcher
  std::uint64_t cancels_written_ = 0;  // of those, written (or dropped with their stream)
  std::list<std::shared_ptr<Watched>> rechecks_;
  std::list<std::pair<std::shared_ptr<Watched>, std::string>> losses_;
  std::list<std::shared_ptr<Watched>> wakes_;  // armed wake-ups to run
  std::map<std::int64_t, std::shared_ptr<Watched>> by_id_;
  // Last: they stop first.
  std::jthread reader_;
  std::jthread worker_;
};

// What arm() returns to the core: destroying it disarms (`before` first, when given).
class ArmedWake final : public WakeArm {
 public:
  ArmedWake(KeyWatcher& watcher, std::shared_ptr<KeyWatcher::Watched> armed, std::function<void()> before = {})
      : watcher_(watcher), armed_(std::move(armed)), before_(std::move(before)) {}
  ~ArmedWake() override {
    if (before_) before_();
    watcher_.disarm(armed_);
  }

 private:
  KeyWatcher& watcher_;
  std::shared_ptr<KeyWatcher::Watched> armed_;
  std::function<void()> before_;
};

}  // namespace turnstile::detail::etcd
