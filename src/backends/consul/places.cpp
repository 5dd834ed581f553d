// SPDX-License-Identifier: Apache-2.0
// Queue entries in Consul's KV store: joining, looking, waiting, taking the hold, leaving.
#include <algorithm>
#include <exception>
#include <set>

#include "backends/consul/consul_backend.hpp"
#include "backends/consul/election.hpp"
#include "backends/consul/given_up.hpp"
#include "backends/consul/holds.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail::consul {
namespace {

bool is_lease(const QueueRequest& request) { return request.kind == EntryKind::lease; }

// What one read of a name saw: our queue and the peers' keys.
struct Snapshot {
  std::shared_ptr<const QueueView> queue;  // turnstile's entries, by CreateIndex
  std::optional<KvEntry> lock_key;         // Mutex: the api.Lock key NAME
  std::vector<KvEntry> under_name;         // Semaphore: NAME/... (.lock and contender keys)
  std::uint64_t under_name_index = 0;      // its X-Consul-Index (0: not read by a GET)
};

class ConsulPlace final : public QueuePlace {
 public:
  ConsulPlace(ConsulBackend& backend, const QueueRequest& request, std::shared_ptr<Session> session)
      : backend_(backend), request_(request), session_(std::move(session)), key_(encode_name(request.name)),
        prefix_(queue_prefix(request.name)), id_(backend.next_id(session_->id)), entry_key_(prefix_ + id_),
        value_(backend.new_value(request)) {}
  ~ConsulPlace() override { leave(); }

  // An exclusive join first tries to take the name outright: when nobody is in the queue (no
  // occupancy key) and the api.Lock key is as this client last released it (or absent), one
  // transaction marks the name occupied, takes the key and adds our entry already held: the
  // uncontended lock costs one round trip, and the occupancy key keeps it from ever jumping a
  // queue or a reader. Otherwise one transaction adds our entry (unless this join was given up:
  // its marker), marks the name occupied, and reads the queue and the peers' keys.
  //
  // A lock's join while this client's other waiters on the name share a query on its queue
  // reads nothing: its first look is that query's first answer that includes our entry (the
  // queue read once for all of the client's joins, not once by each: thousands of waiters).
  Standing join(Deadline deadline, bool try_once) {
    budget_ = CallBudget(deadline);
    backend_.retired_joins().sweep_due(backend_);  // old markers of ended joins, in the background
    const bool exclusive = request_.kind == EntryKind::exclusive;
    if (exclusive && !backend_.crowded(request_.name)) {
      if (auto taken = take_at_once()) return *taken;
    }
    const bool read_later = !try_once && !is_lease(request_) && backend_.blocking_queries().view(prefix_, 0);
    nlohmann::json ops = nlohmann::json::array();
    ops.push_back(kv_op("check-not-exists", marker_key(id_)));
    ops.push_back(kv_lock(entry_key_, to_json(value_), 0, session_->id));
    ops.push_back(occupy());
    if (!read_later) {
      ops.push_back(kv_op("get-tree", prefix_));
      ops.push_back(is_lease(request_) ? kv_op("get-tree", key_ + "/") : kv_op("get-or-empty", key_));
    }
    std::optional<std::vector<KvEntry>> results;
    Refused refused;
    const auto context = "joining the queue of '" + request_.name + "'";
    try {
      results = backend_.txn(ops, one_shot(), context, &refused, request_.stop);
    } catch (const BackendUnavailable&) {
      give_up_join();
      throw_gone_if_stopped();
      throw;
    }
    if (!results) {
      left_ = true;
      // Our session is gone on the server although the lease has not noticed yet.
      if (lose_refused_session(refused, *session_)) throw QueueEntryGone();
      // Nothing else can refuse a new entry (its marker is new too): applied nothing, retried never.
      throw BackendUnavailable(context + ": Consul refused it: " + refused.describe());
    }
    joined_ = true;
    if (read_later) return first_look_later(*results);
    // The first two results are the writes' own (no value); the reads follow.
    const auto written = results->empty() ? 0 : results->front().modify_index;
    results->erase(results->begin(), results->begin() + std::min<std::size_t>(2, results->size()));
    auto standing = stand(snapshot_of(*results, written));
    if (exclusive && standing.entries.size() == 1) backend_.note_crowded(request_.name, false);  // alone in line
    return standing;
  }

  // A join that read nothing waits for the shared query's first answer at our entry's index or
  // later (the core arms that wait: any verdict, take_wait_targets knows).
  Standing first_look_later(const std::vector<KvEntry>& written) {
    for (const auto& entry : written) {
      if (entry.key == entry_key_) first_look_at_ = entry.modify_index;
    }
    if (first_look_at_ == 0)
      throw BackendUnavailable("joining the queue of '" + request_.name + "': no entry in the answer");
    Standing standing;
    standing.decided = Verdict{WaitFor::leave, 0};
    return standing;
  }

  // A join's write ended by the acquire's stop (a cancel while Consul does not answer) has been
  // given up (its marker, give_up_join): the acquire then ends not admitted, as a stop does,
  // rather than with the unanswered call's error.
  void throw_gone_if_stopped() const {
    if (request_.stop.stop_requested()) throw QueueEntryGone();
  }

  // Reads are resent while no server answers (a restart), until the deadline or a stop: then
  // the acquire ends not admitted, as a wait that ran out does.
  Standing look(Deadline deadline) override {
    // An armed wait's query got an answer nobody expects: thrown here, as wait() throws it.
    if (auto error = std::exchange(wait_error_, nullptr)) std::rethrow_exception(error);
    Standing not_admitted;
    not_admitted.decided = Verdict{WaitFor::admission, 0};
    budget_ = CallBudget(deadline);
    // Woken by the client's shared query: its answer (at least as new as the wake) is the queue.
    if (const auto answer = std::exchange(answer_, 0); answer && !is_lease(request_)) {
      if (auto view = backend_.blocking_queries().view(prefix_, answer)) {
        return backend_.look_resending(
            CallBudget(deadline, request_.stop), [&] { return stand(read_lock_key(view)); }, not_admitted);
      }
    }
    return backend_.look_resending(
        CallBudget(deadline, request_.stop), [&] { return look_once(); }, not_admitted);
  }

  Standing look_once() {
    const auto timeout = one_shot();
    Snapshot snapshot;
    // NAME/ before the queue: a waiter for any holder's leave blocks on NAME/ from this read's
    // index, which must be no later than the queue it decides on (else a holder that left in
    // between is seen in the queue but its leave is already behind the index: a lost wake-up).
    // It blocks on the queue from its own read's index as well: a lease ahead that was admitted
    // but leaves before holding changes only the queue.
    if (!is_lease(request_)) return stand(read_lock_queue(timeout));
    snapshot.under_name = backend_.read(key_ + "/", true, timeout, &snapshot.under_name_index);
    std::uint64_t queue_index = 0;
    const auto queue = backend_.read(prefix_, true, timeout, &queue_index);
    snapshot.queue = std::make_shared<const QueueView>(make_queue_view(queue, prefix_, queue_index));
    return stand(snapshot);
  }

  // The api.Lock key alone, beside a queue read before it (a shared query's answer): safe, as
  // entries join at the back, an older queue only shows more ahead of us (a wait), never fewer.
  Snapshot read_lock_key(std::shared_ptr<const QueueView> view) {
    const auto context = "reading the lock of '" + request_.name + "'";
    Refused refused;
    const auto results = backend_.txn(nlohmann::json::array({kv_op("get-or-empty", key_)}), one_shot(), context,
                                      &refused, request_.stop);
    if (!results) throw BackendUnavailable(context + ": Consul refused it: " + refused.describe());
    auto snapshot = snapshot_of(*results);
    snapshot.queue = std::move(view);
    return snapshot;
  }

  // A lock's queue and the api.Lock key in one read-only transaction: one round trip, and one
  // snapshot of both (a lock's waits need no X-Consul-Index: they block on an entry's or the
  // key's ModifyIndex).
  Snapshot read_lock_queue(milliseconds timeout) {
    const auto ops = nlohmann::json::array({kv_op("get-tree", prefix_), kv_op("get-or-empty", key_)});
    const auto context = "reading the queue of '" + request_.name + "'";
    Refused refused;
    const auto results = backend_.txn(ops, timeout, context, &refused, request_.stop);
    // Reads refuse nothing (a missing key is an empty result): a refusal is a server we do not know.
    if (!results) throw BackendUnavailable(context + ": Consul refused it: " + refused.describe());
    return snapshot_of(*results);
  }

  // The reads of a transaction, sorted: our queue's entries, the api.Lock key (absent when
  // get-or-empty found none), the keys under NAME/. `index`: the state they were read at, if known.
  Snapshot snapshot_of(const std::vector<KvEntry>& results, std::uint64_t index = 0) const {
    Snapshot snapshot;
    snapshot.queue = std::make_shared<const QueueView>(make_queue_view(results, prefix_, index));
    for (const auto& entry : results) {
      if (entry.key == key_) snapshot.lock_key = entry;
      else if (entry.key.rfind(prefix_, 0) != 0 && entry.key.rfind(key_ + "/", 0) == 0) {
        snapshot.under_name.push_back(entry);
      }
    }
    if (snapshot.lock_key && snapshot.lock_key->create_index == 0) snapshot.lock_key.reset();
    return snapshot;
  }

  void wait(const Verdict& verdict, Deadline deadline, const std::stop_token& stop) override {
    answer_ = backend_.block(take_wait_targets(verdict), CallBudget(deadline, stop));
  }

  // The same queries on the client's I/O thread: no thread waits.
  std::unique_ptr<WakeArm> arm(const Verdict& verdict, Deadline deadline, Wake wake) override {
    return backend_.arm_block(take_wait_targets(verdict), deadline,
                              [this, wake = std::move(wake)](std::exception_ptr error, std::uint64_t answer) {
                                wait_error_ = std::move(error);  // the next look throws it
                                answer_ = answer;                // ... or decides on that answer
                                wake();
                              });
  }

  // What the event `verdict` names is watched on: any holder's leave on NAME/ and our queue (a
  // lease ahead may leave before it held), else the entry (or peer's key) it waits for; a join
  // that read nothing, the shared query's answer that includes it. The last look's view goes
  // (the next look reads it again): a waiter's memory stays the same however long the queue
  // ahead, as the core's (thousands of waiters on one name).
  std::vector<WaitTarget> take_wait_targets(const Verdict& verdict) {
    std::vector<WaitTarget> watched;
    if (const auto at = std::exchange(first_look_at_, 0)) {
      watched = {{entry_key_, at, false, false, true}};
    } else if (verdict.wait == WaitFor::any_holder_leave) {
      watched = {holders_target_, queue_target_};
    } else if (verdict.index < front_targets_.size()) {
      watched = {front_targets_[verdict.index]};
    } else if (view_ && verdict.index - front_targets_.size() < view_->entries.size()) {
      const auto& entry = view_->entries[verdict.index - front_targets_.size()];
      watched = {{entry.key, entry.modify_index, false, false}};
    }
    std::vector<WaitTarget>().swap(front_targets_);
    view_.reset();
    return watched;
  }

  // The hold's own operations, after the permit's: the take of the api.Lock key (its index is
  // returned) or the mark of our entry held, then the reads that come back with it.
  std::optional<std::size_t> add_take_ops(bool exclusive, nlohmann::json& ops) const {
    std::optional<std::size_t> lock_op;
    if (exclusive) {
      lock_op = ops.size();
      ops.push_back(kv_lock(key_, lock_key_value(request_), kLockFlags, session_->id));
      ops.push_back(kv_check_session(entry_key_, session_->id));
      // A leader's entry marked held: its ModifyIndex is then its token, which a proclaim keeps.
      if (value_.election) ops.push_back(kv_lock(entry_key_, to_json(value_), 0, session_->id));
    } else {
      // Only while the entry is still ours: a late copy of this transaction, delivered after
      // release_unknown_hold removed the entry, must not bring it back held.
      ops.push_back(kv_check_session(entry_key_, session_->id));
      ops.push_back(kv_lock(entry_key_, to_json(value_), 0, session_->id));
    }
    // Read in the same step: the occupancy key's index then, so that our release can end the
    // occupancy if nobody joins meanwhile (last_in_line).
    ops.push_back(kv_op("get-or-empty", occupancy_key(request_.name)));
    return lock_op;
  }

  // An exclusive hold takes the api.Lock key and only checks that our entry is still ours: its
  // entry is left as it is, so the one waiting behind it (blocked on its ModifyIndex) sleeps on
  // until it leaves, and a release wakes exactly one waiter. It reads as held because it heads the
  // queue while its session holds the key (inspect); its fencing token is the key's ModifyIndex.
  // A reader or a lease marks its entry held (with the lease's permit session): a lease's
  // successor waits for exactly that write (WaitFor::admission).
  std::unique_ptr<BackendHold> hold(std::shared_ptr<LossSignal> loss) override {
    if (taken_at_once_) {
      left_ = true;  // the hold owns the entry now
      return make_hold(backend_, {.name = request_.name,
                                  .session = session_,
                                  .entry_key = entry_key_,
                                  .value = value_,
                                  .permits = {},
                                  .token = token_,
                                  .loss = std::move(loss),
                                  .last_in = last_in_});
    }
    const bool exclusive = request_.kind == EntryKind::exclusive;
    value_.held = !exclusive || value_.election;
    std::vector<std::shared_ptr<Session>> permits;
    nlohmann::json ops = nlohmann::json::array();
    if (is_lease(request_)) {
      permits.push_back(backend_.sessions().spare(one_shot()));
      add_permit_ops(*permits.front(), ops);
    }
    const auto lock_op = add_take_ops(exclusive, ops);
    std::optional<std::vector<KvEntry>> results;
    Refused refused;
    try {
      results = backend_.txn(ops, one_shot(), "taking '" + request_.name + "'", &refused);
    } catch (const BackendUnavailable&) {
      release_unknown_hold(std::move(permits));
      throw;
    }
    if (!results && is_lease(request_) && refused.at(0, Refusal::exists)) {
      results = applied_before();  // our own earlier delivery of it
    }
    if (!results) refused_hold(refused, lock_op, std::move(permits));
    std::uint64_t token = 0;
    std::uint64_t occupancy = 0;
    for (const auto& entry : *results) {
      if (entry.key == (exclusive ? key_ : entry_key_)) token = std::max(token, entry.modify_index);
      if (entry.key == occupancy_key(request_.name) && entry.create_index != 0) occupancy = entry.modify_index;
    }
    left_ = true;  // the hold owns the entry now
    return make_hold(backend_, {.name = request_.name,
                                .session = session_,
                                .entry_key = entry_key_,
                                .value = value_,
                                .permits = std::move(permits),
                                .token = token,
                                .loss = std::move(loss),
                                // Ours alone in line now: the last look saw it alone and nobody
                                // joined since (every join writes the occupancy key; Raft indexes
                                // are one sequence for every key). Else 0 (the queue is not read).
                                .last_in = alone_at_ && occupancy && occupancy <= alone_at_ ? occupancy : 0});
  }

  void leave() noexcept override { leave_within(kConsulTimes.leave_try); }
  // A client's end: its pending acquires leave by one deadline (what is left goes to the
  // background at once, drained by drain_at_end as the backend ends).
  void leave_by(Deadline deadline) noexcept override { leave_within(leave_patience(deadline, kConsulTimes.leave_try)); }
  void leave_within(milliseconds patience) noexcept {
    if (left_) return;
    left_ = true;
    if (joined_) leave_queue(backend_, session_, request_.name, entry_key_, patience);
  }

 private:
  // A call that must reach Consul once, under the acquire's deadline.
  milliseconds one_shot() const { return budget_.call_timeout(kConsulTimes.one_shot); }

  // One session holds the lease's permits, its count in `.lock` (layout.hpp). Its contender key
  // comes first: already there, it tells a resend of this very transaction (libcurl resends a
  // request whose kept-alive connection died unanswered) from a lost race.
  void add_permit_ops(const Session& permit, nlohmann::json& ops) {
    ops.push_back(kv_op("check-not-exists", key_ + "/" + permit.id));
    auto lock = semaphore_;
    ops.push_back(kv_lock(key_ + "/" + permit.id, "", kSemaphoreFlags, permit.id));
    lock.holders[permit.id] = request_.permits;
    value_.sessions = {permit.id};
    auto op = kv_op("cas", key_ + "/.lock");
    op["KV"]["Index"] = lock.modify_index;
    op["KV"]["Value"] = base64_encode(to_json(lock));
    op["KV"]["Flags"] = kSemaphoreFlags;
    ops.push_back(op);
  }

  // A hold's transaction refused (by the reasons the refusal reader left): our session gone
  // ends our place; anything else (the key held by someone we have not seen yet, a lock-delay,
  // `.lock` changed, our entry gone) is a look again.
  [[noreturn]] void refused_hold(const Refused& refused, std::optional<std::size_t> lock_op,
                                 std::vector<std::shared_ptr<Session>> permits) {
    value_.held = false;
    value_.sessions.clear();
    if (lose_refused_session(refused, *session_)) {
      left_ = true;
      throw QueueEntryGone();
    }
    for (auto& permit : permits) {
      if (!lose_refused_session(refused, *permit)) backend_.sessions().give_back(std::move(permit));
    }
    retry_soon_ = lock_op && (refused.at(*lock_op, Refusal::lock_held) || refused.at(*lock_op, Refusal::lock_delay));
    // A CAS on `.lock` lost to someone else's change: the core's RacePacer pauses before the
    // look again, and a try-once ends not admitted after a few quick retries.
    throw QueueChanged();
  }

  // A hold whose answer never came may have been applied (the peers' key, `.lock`, the permits'
  // keys): nobody knows of it, so it is released as a hold would be, in the background.
  void release_unknown_hold(std::vector<std::shared_ptr<Session>> permits) noexcept {
    left_ = true;  // the release below removes the entry too
    try {
      std::shared_ptr<BackendHold> orphan =
          make_hold(backend_, {.name = request_.name,
                               .session = session_,
                               .entry_key = entry_key_,
                               .value = value_,
                               .permits = std::move(permits),
                               .loss = std::make_shared<LossSignal>(request_.name, nullptr)});
      // A release that finds no server throws BackendUnavailable: the service tries again.
      backend_.removals().add("a hold on '" + request_.name + "' whose take was not answered", [orphan] {
        orphan->release();
        return Removal::done;
      });
    } catch (...) {
      // No memory for the job: the entry and keys go with their sessions.
    }
  }

  // The occupancy key written with our entry's id: a value no join wrote before, so its
  // ModifyIndex moves with every join (Consul skips a write that changes nothing).
  nlohmann::json occupy() const {
    auto op = kv_op("set", occupancy_key(request_.name));
    op["KV"]["Value"] = base64_encode(id_);
    return op;
  }

  // The one-step exclusive take (see join): nullopt when the name is not free as this client
  // last saw it (someone is in the queue, or the key moved on): then the ordinary join follows.
  std::optional<Standing> take_at_once() {
    const auto released = backend_.released_lock_index(request_.name);
    value_.held = true;
    nlohmann::json ops = nlohmann::json::array();
    ops.push_back(kv_op("check-not-exists", marker_key(id_)));
    ops.push_back(kv_op("check-not-exists", entry_key_));  // fails only on a resend of ours
    ops.push_back(kv_op("check-not-exists", occupancy_key(request_.name)));
    if (released) {
      auto op = kv_op("check-index", key_);
      op["KV"]["Index"] = *released;
      ops.push_back(op);
    } else {
      // A key we do not know may be someone else's (other flags): the ordinary join reads it first.
      ops.push_back(kv_op("check-not-exists", key_));
    }
    ops.push_back(occupy());
    ops.push_back(kv_lock(key_, lock_key_value(request_), kLockFlags, session_->id));
    ops.push_back(kv_lock(entry_key_, to_json(value_), 0, session_->id));
    std::optional<std::vector<KvEntry>> results;
    Refused refused;
    try {
      results = backend_.txn(ops, one_shot(), "taking '" + request_.name + "'", &refused, request_.stop);
    } catch (const BackendUnavailable&) {
      joined_ = true;
      give_up_join(true);
      throw_gone_if_stopped();
      throw;
    }
    if (!results && refused.at(1, Refusal::exists)) results = applied_before();  // our own earlier delivery
    if (!results) {
      value_.held = false;
      if (lose_refused_session(refused, *session_)) {
        left_ = true;
        throw QueueEntryGone();
      }
      if (refused.at(2, Refusal::exists)) backend_.note_crowded(request_.name, true);  // others in line
      // The key is not as we left it: forgotten, so the next join reads it first.
      if (refused.at(3, Refusal::check_failed) || refused.at(3, Refusal::exists)) {
        backend_.note_released_lock(request_.name, {});
      }
      return std::nullopt;
    }
    joined_ = true;
    taken_at_once_ = true;
    for (const auto& entry : *results) {
      if (entry.key == entry_key_) token_ = entry.modify_index;
      if (entry.key == occupancy_key(request_.name)) last_in_ = entry.modify_index;
    }
    Standing standing;
    standing.decided = Verdict{};
    return standing;
  }

  // After a refusal that says our entry or permit key was already written: our own earlier
  // delivery of the same transaction applied. Its results as a read of our entry finds them
  // (the occupancy left unknown: the release then keeps it, and a later last one out ends it).
  std::optional<std::vector<KvEntry>> applied_before() {
    auto entries = backend_.read(entry_key_, false, one_shot());
    if (entries.empty() || entries.front().session != session_->id) {
      left_ = true;
      throw QueueEntryGone();  // applied, then gone with its session
    }
    return entries;
  }

  // A join whose answer never came may still be applied: its marker (on our session, so it
  // goes with it) keeps a late delivery from adding the entry, and the entry goes if it came,
  // and with it the occupancy it wrote, when nobody else is in line.
  // `took_key`: the join may also have taken the api.Lock key (take_at_once), which is then
  // released with the entry, by the transaction that checks the entry is ours.
  void give_up_join(bool took_key = false) noexcept {
    left_ = true;
    try {
      nlohmann::json undo = nlohmann::json::array();
      undo.push_back(kv_check_session(entry_key_, session_->id));
      if (took_key) undo.push_back(kv_unlock(key_, kLockFlags, session_->id));
      undo.push_back(kv_op("delete", entry_key_));
      retire_join(backend_, session_, id_, std::move(undo), kConsulTimes.leave_try, request_.name);
    } catch (...) {
      // No memory for the job: the entry goes with the session.
    }
  }

  Standing stand(const Snapshot& snapshot) {
    const auto& queue = snapshot.queue->entries;
    const auto mine =
        std::find_if(queue.begin(), queue.end(), [&](const QueuedEntry& e) { return e.key == entry_key_; });
    if (mine == queue.end()) {
      left_ = true;
      throw QueueEntryGone();
    }
    // Ours alone in line: as of which index (a hold then reads whether anyone joined since).
    alone_at_ = queue.size() == 1 ? std::max(snapshot.queue->index, mine->modify_index) : 0;
    Standing standing;
    front_targets_.clear();
    if (is_lease(request_)) add_semaphore_holders(snapshot, standing);
    else add_lock_holder(snapshot, standing);
    standing.entries.reserve(standing.entries.size() + static_cast<std::size_t>(mine - queue.begin()) + 1);
    for (auto it = queue.begin(); it <= mine; ++it) {
      standing.entries.push_back({it->kind, it->permits});
      if (it != mine && standing.mode == QueueMode::none) {
        standing.mode = queue_mode_of(*it);
        standing.limit = it->limit;
      }
    }
    view_ = snapshot.queue;  // the entries' wait targets, until the wait takes one
    return standing;
  }

  // An api.Lock holder that is not our queue's head goes in front; so does a lock-delay we ran into.
  void add_lock_holder(const Snapshot& snapshot, Standing& standing) {
    const bool retry = std::exchange(retry_soon_, false);
    if (!snapshot.lock_key) {
      // Refused with the key absent: a lock-delay (a session invalidated with it deleted the
      // key). Wait that out in front of our entry rather than try again at once.
      if (retry) {
        standing.entries.push_back({EntryKind::exclusive, 1});
        front_targets_.push_back({key_, 0, false, true});
      }
      return;
    }
    const auto& key = *snapshot.lock_key;
    const bool foreign = !key.session.empty() && key.session != snapshot.queue->entries.front().session;
    // A released key (api.Lock leaves it behind) says nothing, nor ours (our entries do).
    standing.mode = lock_key_mode(request_, key, foreign);
    if (!foreign && !(retry && key.session.empty())) return;
    standing.entries.push_back({EntryKind::exclusive, 1});
    front_targets_.push_back({key.key, key.modify_index, false, !foreign});
  }

  // api.Semaphore holders in `.lock` (dead ones pruned) that are not our queue's go in front.
  void add_semaphore_holders(const Snapshot& snapshot, Standing& standing) {
    semaphore_ = SemaphoreLock{request_.limit, {}, 0};
    holders_target_ = {key_ + "/", snapshot.under_name_index, true, false};
    queue_target_ = {prefix_, snapshot.queue->index, true, false};
    std::set<std::string> alive;
    for (const auto& entry : snapshot.under_name) {
      if (!entry.session.empty()) alive.insert(entry.session);
    }
    for (const auto& entry : snapshot.under_name) {
      if (entry.key == key_ + "/.lock") semaphore_ = semaphore_lock(entry, request_.name);
    }
    std::erase_if(semaphore_.holders, [&](const auto& holder) { return !alive.count(holder.first); });
    // A `.lock` with no live holder left behind (api.Semaphore's Release keeps it) says nothing.
    const bool holding = std::any_of(semaphore_.holders.begin(), semaphore_.holders.end(),
                                     [](const auto& holder) { return holder.second > 0; });
    if (holding) {
      standing.mode = QueueMode::semaphore;
      standing.limit = semaphore_.limit;
    } else {
      // Its Limit is no one's any more: our hold writes the limit in force, the request's (a
      // stale Limit kept would let api.Semaphore peers count against a limit nobody asked for).
      semaphore_.limit = request_.limit;
    }
    std::set<std::string> ours;
    for (const auto& entry : snapshot.queue->entries) {
      for (const auto& session : entry.sessions) ours.insert(session);
    }
    for (const auto& [session, permits] : semaphore_.holders) {
      if (permits <= 0 || ours.count(session)) continue;
      standing.entries.push_back({EntryKind::lease, permits});
      front_targets_.push_back(holders_target_);
    }
  }

  ConsulBackend& backend_;
  QueueRequest request_;
  std::shared_ptr<Session> session_;
  std::string key_;     // the peers' key: NAME (api.Lock), NAME/ (api.Semaphore)
  std::string prefix_;  // our queue
  std::string id_;
  std::string entry_key_;
  EntryValue value_;
  // What each entry of the last look is waited on by: the ones put in front of the queue, then
  // the queue's (view_'s, shared with the client's other waiters that looked at it).
  std::vector<WaitTarget> front_targets_;
  std::shared_ptr<const QueueView> view_;
  WaitTarget holders_target_;   // any holder's leave: NAME/ (api.Semaphore's and ours) ...
  WaitTarget queue_target_;     // ... and our queue (a lease ahead leaving before it held)
  SemaphoreLock semaphore_;     // `.lock` as the last look saw it, pruned
  CallBudget budget_;           // the acquire's deadline, for hold()
  bool taken_at_once_ = false;  // take_at_once took the name: hold() has nothing left to write
  std::uint64_t token_ = 0;     // then: its fencing token
  std::uint64_t last_in_ = 0;   // then: the occupancy key's index (we are the only one in)
  bool joined_ = false, left_ = false, retry_soon_ = false;
  std::exception_ptr wait_error_;    // from an armed wait, for the next look
  std::uint64_t answer_ = 0;         // the shared answer that woke the wait (0: none), for the next look
  std::uint64_t first_look_at_ = 0;  // a join that read nothing: our entry's index, for its wait
  std::uint64_t alone_at_ = 0;       // the last look saw ours alone in line, as of this index
};

}  // namespace

std::unique_ptr<QueuePlace> make_place(ConsulBackend& backend, const QueueRequest& request, bool try_once,
                                       Deadline deadline, Standing& first) {
  const auto session = backend.sessions().main(CallBudget(deadline).call_timeout(kConsulTimes.one_shot));
  auto place = std::make_unique<ConsulPlace>(backend, request, session);
  first = place->join(deadline, try_once);
  return place;
}

}  // namespace turnstile::detail::consul
