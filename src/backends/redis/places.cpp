// SPDX-License-Identifier: Apache-2.0
#include "backends/redis/redis_backend.hpp"
#include "backends/redis/scripts.hpp"

namespace turnstile::detail::redis {
namespace {

char kind_code(EntryKind kind) {
  switch (kind) {
    case EntryKind::exclusive: return 'x';
    case EntryKind::shared: return 's';
    case EntryKind::lease: return 'l';
  }
  return 'x';
}

// The mode acquire.lua names in a kind mismatch.
QueueMode mode_named(const std::string& mode) {
  if (mode == "semaphore") return QueueMode::semaphore;
  return mode == "election" ? QueueMode::election : QueueMode::lock;
}

// The first element of a script's array reply when it is an integer, else -1000.
long long first_integer(const redisReply* reply) {
  if (!reply || reply->type != REDIS_REPLY_ARRAY || reply->elements == 0) return -1000;
  const auto* first = reply->element[0];
  return first->type == REDIS_REPLY_INTEGER ? first->integer : -1000;
}

}  // namespace

// Our entry in a name's queue. The Lua scripts evaluate the queue atomically (admit()), so every
// look answers with the verdict itself: admitted or waiting.
class RedisPlace final : public QueuePlace {
 public:
  RedisPlace(RedisBackend& backend, const QueueRequest& request, bool may_wait)
      : backend_(backend), name_(request.name), keys_(backend.keys_of(request.name)),
        join_(backend.request_ids_.open(keys_.keys.back())), request_id_(backend.request_ids_.id(join_)),
        stop_(request.stop) {
    if (may_wait) {
      listener_.emplace(backend.waiters_, backend.subscriber_, Waiters::Line::queue, keys_.channel);
      backend.waiters_.update(listener_->waiter, [&](Waiters::Waiter& w) {
        w.name = name_;
        w.request = request_id_;
      });
    }
  }

  ~RedisPlace() override {
    // An acquire that ended in an error reply: the server changed nothing.
    if (!join_answered_ && !left_) backend_.request_ids_.settle(keys_.keys.back(), join_);
  }

  // Runs the acquire script: admitted or not; none when no entry stays (not admitted on a
  // try-once, or a stop during the call, after which the entry it may have made has left).
  // At least the one-shot floor, whatever the deadline: the answer decides (admitted: the hold; not,
  // with the deadline passed: the core leaves and reports a timeout).
  std::optional<bool> join(const QueueRequest& request, bool try_once, Deadline deadline) {
    const auto sent_at = SteadyClock::now();
    Reply reply;
    Reply replicas;  // WAIT's answer, with min_replicas and an admitted entry
    const auto follow_up = backend_.replica_wait(deadline, [](const redisReply* r) { return first_integer(r) == 1; });
    try {
      reply = backend_.connection_.eval(scripts::acquire, keys_.keys, join_args(request, try_once),
                                        {.budget = {at_least_floor(deadline), stop_},
                                         .idempotent = true,
                                         .server = &server_,
                                         .follow_up = &follow_up,
                                         .follow_reply = &replicas});
      // Answered: the server knows what this acquire did, and a late copy of it finds that out.
      backend_.request_ids_.settle(keys_.keys.back(), join_);
      join_answered_ = true;
    } catch (const BackendUnavailable&) {
      // The script may have run and its reply been lost: take out the entry it may have made
      // (found by our request id) rather than leave it to hold up the name for a TTL. A one-shot
      // join (deadline within the floor) ends within its floor: the leave gets what is left of
      // it, then the watchdog retires the request.
      const auto floor_end = sent_at + kRedisTimes.one_shot.floor;
      const bool one_shot = deadline && *deadline <= floor_end;
      leave_within(
          one_shot ? std::max(milliseconds(0), std::chrono::duration_cast<milliseconds>(floor_end - SteadyClock::now()))
                   : kRedisTimes.leave_try);
      if (stop_.stop_requested()) return std::nullopt;
      throw;
    }
    const auto status = integer_at(reply.get(), 0);
    if (status == -1) check_queue_mode(request, mode_named(string_at(reply.get(), 1)), 0);
    if (status == -2) check_queue_mode(request, QueueMode::semaphore, integer_at(reply.get(), 1));
    if (status == 0) return std::nullopt;
    if (status != 1 && status != 2)
      throw BackendUnavailable("redis answered acquire with status " + std::to_string(status));
    seq_ = token_at(reply.get(), 1);
    if (listener_) {
      backend_.waiters_.update(listener_->waiter, [&](Waiters::Waiter& w) { w.renewed_at = sent_at; });
      backend_.waiters_.set_seq(keys_.channel, listener_->waiter, std::to_string(seq_));
    }
    if (status == 1 && backend_.settings_.min_replicas > 0) {
      try {
        backend_.check_replicas(replicas);
      } catch (...) {
        leave();  // nothing is left behind: the entry goes
        throw;
      }
    }
    if (status == 1) admitted_at_ = sent_at;
    // Waiting: from now on the watchdog renews our entry with the client's others of the name,
    // and wakes us when it finds it admitted or gone (a message lost, or an entry ahead expired).
    if (status == 2 && listener_ && backend_.waiters_.set_queued(listener_->waiter, true)) backend_.renew_soon();
    return status == 1;
  }

  // acquire.lua's arguments (see its head).
  std::vector<std::string> join_args(const QueueRequest& request, bool try_once) {
    std::vector<std::string> args{keys_.channel,
                                  std::string(1, kind_code(request.kind)),
                                  std::to_string(request.permits),
                                  std::to_string(request.limit),
                                  std::to_string(backend_.settings_.ttl.count()),
                                  try_once ? "1" : "0",
                                  backend_.request_ids_.marked(keys_.keys.back(), join_),
                                  backend_.identity_,
                                  backend_.label_suffix_};
    if (request.primitive == Primitive::election) args.push_back(request.value);  // its 'v<seq>'
    return args;
  }

  Standing look(Deadline deadline) override {
    // A stop ends the wait without asking: the core gives up on "waiting" and leaves.
    if (stop_.stop_requested()) return standing(false);
    if (listener_) {
      bool named = false;  // a message named our entry since the last look
      SteadyClock::time_point renewed_at;
      backend_.waiters_.update(listener_->waiter, [&](Waiters::Waiter& w) {
        w.poked = false;  // a message from now on wakes the next sleep
        named = std::exchange(w.named, false);
        renewed_at = w.renewed_at;
      });
      if (named && admitted_as_named(deadline, renewed_at)) return standing(true);
    }
    const auto sent_at = SteadyClock::now();
    Reply reply;
    Reply replicas;  // WAIT's answer, with min_replicas once admitted
    const auto follow_up = backend_.replica_wait(deadline, [](const redisReply* r) { return first_integer(r) == 2; });
    try {
      reply = backend_.connection_.eval(
          scripts::renew, keys_.keys,
          {keys_.channel, std::to_string(backend_.settings_.ttl.count()), std::to_string(seq_), request_id_},
          {.budget = {deadline, stop_},
           .idempotent = true,
           .server = &server_,
           .follow_up = &follow_up,
           .follow_reply = &replicas});
    } catch (const BackendUnavailable&) {
      // Ended by the stop or the deadline: not admitted (the core gives up and leaves).
      if (stop_.stop_requested() || passed(deadline)) return standing(false);
      throw;
    }
    const auto where = integer_at(reply.get(), 0);
    if (where == 0) {
      // Gone (we were paused past the TTL, or the server lost the name's state): nothing to leave.
      left_ = true;
      if (listener_) backend_.waiters_.set_queued(listener_->waiter, false);
      throw QueueEntryGone();
    }
    // Not replicated: NotReplicated ends the acquire, and the core takes our entry out.
    if (where == 2 && backend_.settings_.min_replicas > 0) backend_.check_replicas(replicas);
    if (where == 2) admitted_at_ = sent_at;
    if (listener_) backend_.waiters_.update(listener_->waiter, [&](Waiters::Waiter& w) { w.renewed_at = sent_at; });
    return standing(where == 2);
  }

  // A message named our entry: the script that published it (a release, a renewal that pruned
  // an expired holder) admitted it. Whether the server's state says so is read with one plain
  // HGET, no script: our entry, admitted, and alive: the call sent at `renewed_at` renewed its
  // lease and the HGET's answer came back within half of the TTL since, by our clock, so the
  // server read the entry before it could expire (the loss rule's argument; a plain HGET, unlike
  // the script, would still read an expired entry). The hold's lease counts from `renewed_at`.
  // Anything
  // else (not admitted, gone, unreadable, no answer) leaves it to the renewal script's look.
  // Only on a single server: with sentinels or a cluster, which server answers decides, and
  // the script's look keeps track of that.
  bool admitted_as_named(Deadline deadline, SteadyClock::time_point renewed_at) {
    const auto& settings = backend_.settings_;
    if (settings.sentinel() || settings.cluster() || settings.min_replicas > 0) return false;
    // Within half of the TTL since the renewal was sent: the entry cannot have expired yet.
    const auto fresh = [&] { return SteadyClock::now() < renewed_at + settings.ttl / 2; };
    if (!fresh()) return false;
    Reply entry;
    try {
      const auto& state_key = keys_.keys.front();
      entry = backend_.connection_.command({"HGET", state_key, std::to_string(seq_)}, {deadline, stop_}, state_key);
    } catch (const BackendUnavailable&) {
      return false;
    }
    // Answered late (the request or the server held up): the entry may have expired before the
    // server read it. The script's look decides, as it drops an expired entry.
    if (!fresh()) return false;
    // "<kind><admitted> <permits> <limit> <request> <until ms> ..." (queue_prelude.lua)
    const auto text = reply_view(entry.get());
    std::size_t request_at = 0;  // after the third space
    for (int field = 0; field < 3 && request_at != std::string_view::npos; ++field) {
      request_at = text.find(' ', request_at);
      if (request_at != std::string_view::npos) ++request_at;
    }
    if (text.size() < 2 || text[1] != '1' || request_at == std::string_view::npos) return false;
    if (text.substr(request_at, request_id_.size() + 1) != request_id_ + " ") return false;
    admitted_at_ = renewed_at;
    return true;
  }

  // Whatever the verdict names, the script that admits us publishes our seq: we sleep until a
  // message names us, the subscriber reconnects, or the watchdog's round (every TTL/3 and at
  // most kMaxRecheck apart while we wait) finds our entry admitted or gone. Sleeping, a waiter
  // sends nothing: its lease is renewed by that round, in one call for all of the client's
  // entries of the name.
  void wait(const Verdict&, Deadline deadline, const std::stop_token& stop) override {
    const CallBudget budget(deadline, stop);
    if (!listener_ || listener_->subscribe(budget)) return;
    listener_->sleep(std::nullopt, budget);
  }
  // The same events without a thread: the wake runs on the subscriber's thread (a message
  // naming our seq, its reconnect, the confirmation of a new subscription) or the watchdog's
  // (its round found our entry admitted or gone). Nothing is sent: the subscription is asked
  // for, not waited for.
  std::unique_ptr<WakeArm> arm(const Verdict& verdict, Deadline deadline, Wake wake) override {
    if (!listener_) return QueuePlace::arm(verdict, deadline, std::move(wake));  // a try-once: never
    return listener_->arm(std::move(wake));
  }

  std::unique_ptr<BackendHold> hold(std::shared_ptr<LossSignal> loss) override {
    left_ = true;  // the hold owns the entry now
    if (listener_) backend_.waiters_.set_queued(listener_->waiter, false);
    // The lease counts from the send time of the script that found us admitted.
    return std::make_unique<RedisHold>(backend_, name_, seq_, join_, std::move(loss),
                                       backend_.loss_clock_.watch(backend_.settings_.ttl, admitted_at_), server_);
  }

  void leave() noexcept override { leave_within(kRedisTimes.leave_try); }
  // A client's end: its pending acquires leave by one deadline (what is left goes to the
  // background at once, one try each at the backend's end).
  void leave_by(Deadline deadline) noexcept override { leave_within(leave_patience(deadline, kRedisTimes.leave_try)); }
  void leave_within(milliseconds patience) noexcept {
    if (std::exchange(left_, true)) return;
    if (listener_) backend_.waiters_.set_queued(listener_->waiter, false);
    // By request id alone while the seq is unknown (the acquire's reply was lost).
    backend_.leave(name_, seq_ ? std::to_string(seq_) : std::string(), join_, !join_answered_, patience);
  }

  // The script decided; the queue is in our mode (it refuses a request of another).
  Standing standing(bool admitted) const {
    Standing standing;
    standing.decided = admitted ? Verdict{} : Verdict{WaitFor::admission, 0};
    return standing;
  }

 private:
  RedisBackend& backend_;
  std::string name_;
  QueueKeys keys_;
  // One id per entry: a release by request id finds it even when the acquire's reply was lost.
  std::uint64_t join_;
  std::string request_id_;
  bool join_answered_ = false;  // else its number stays in flight until the leave retires it
  std::stop_token stop_;
  std::optional<Listener> listener_;  // none on a try-once: it never waits
  std::uint64_t seq_ = 0;             // 0 until the acquire answered
  std::string server_;                // the server that answered the last script (Opened::server)
  SteadyClock::time_point admitted_at_{};
  bool left_ = false;
};

// What wakes an election's observer: any message on the name's channel (an admission, a
// proclaim), the subscriber's reconnect, else a poll: a leader that leaves with nobody behind it
// publishes nothing.
class RedisLeaderWatch final : public LeaderWatch {
 public:
  RedisLeaderWatch(RedisBackend& backend, const std::string& name)
      : listener_(backend.waiters_, backend.subscriber_, Waiters::Line::queue, backend.keys_of(name).channel) {}

  void wait(Deadline deadline, const std::stop_token& stop) override {
    const CallBudget budget(deadline, stop);
    if (!listener_.subscribe(budget)) listener_.sleep(Backend::kLeaderPoll, budget);
    listener_.unpoke();  // a message during the core's next read wakes the next wait at once
  }

 private:
  Listener listener_;
};

std::unique_ptr<LeaderWatch> RedisBackend::watch_leader(const std::string& name) {
  return std::make_unique<RedisLeaderWatch>(*this, name);
}

std::unique_ptr<QueuePlace> RedisBackend::join(const QueueRequest& request, bool try_once, Deadline deadline,
                                               Standing& first) {
  auto place = std::make_unique<RedisPlace>(*this, request, !try_once);
  const auto admitted = place->join(request, try_once, deadline);
  if (!admitted) return nullptr;
  first = place->standing(*admitted);
  return place;
}

}  // namespace turnstile::detail::redis
