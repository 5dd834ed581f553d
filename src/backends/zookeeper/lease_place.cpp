// SPDX-License-Identifier: Apache-2.0
#include <optional>

#include "backends/zookeeper/counts.hpp"
#include "backends/zookeeper/places.hpp"

namespace turnstile::detail::zookeeper {

namespace {

// Semaphore: InterProcessSemaphoreV2's layout. The line `locks` is a mutex whose head alone may
// add leases (one node of `leases` per permit), so the transaction that adds ours and leaves the
// line is atomic with the count it was decided on. Presented to the core in two stages: in line,
// the line up to ours as exclusive entries (wait for the one just ahead to leave); at its head,
// the held leases (one permit each) followed by ours, under the limit.
class LeasePlace final : public EntryPlace {
 public:
  LeasePlace(ZookeeperBackend& backend, std::shared_ptr<Session> session, const QueueRequest& request, bool try_once)
      : EntryPlace(backend, session, request, backend.path_of(request.name) + "/locks", kMutexLabel,
                   node_data("lease", backend.holder_label(), request.permits)),
        leases_(path_ + "/leases"), lease_prefix_(leases_ + "/" + protected_name(uuid_, kLeaseLabel)),
        try_once_(try_once) {
    backend.check_lease_request(request, lease_prefix_, data_);
  }

  Standing look(Deadline deadline) override {
    return through_outages(deadline, [&] { return look_once(deadline); });
  }
  Standing look_once(Deadline deadline) {
    return queue_step([&] {
      deadline_ = deadline;
      const auto bound = backend_.call_bound(*session_, {deadline, request_.stop});
      // A lock or an election on the same name is a kind mismatch (joined first, then looked).
      auto in_use = QueueMode::none;
      if (!lock_checked_) {
        const auto entries = sorted_entries(backend_.list(*session_, path_, false, bound));
        if (!entries.empty()) in_use = entries.front().latch ? QueueMode::election : QueueMode::lock;
      }
      lock_checked_ = true;
      const auto line = entries_up_to_ours(list_parent(bound));
      remember(line);
      auto standing = line.size() > 1 ? look_in_line(line.size(), bound) : look_at_head(bound);
      if (in_use != QueueMode::none) standing.mode = in_use;
      return standing;
    });
  }
  void wait(const Verdict& verdict, Deadline deadline, const std::stop_token& stop) override {
    if (verdict.wait != WaitFor::any_holder_leave) return EntryPlace::wait(verdict, deadline, stop);
    std::vector<std::string>().swap(nodes_);  // not kept while we sleep (see EntryPlace::waited_for)
    queue_step([&] {
      if (leases_watch_) leases_watch_->sleep({deadline, stop});
      leases_watch_.reset();
      check_session(*session_, ZOK);
    });
  }
  // The leases' watch, set by the look at the head of the line, runs `wake` instead.
  std::unique_ptr<WakeArm> arm(const Verdict& verdict, Deadline deadline, Wake wake) override {
    if (verdict.wait != WaitFor::any_holder_leave) return EntryPlace::arm(verdict, deadline, std::move(wake));
    std::vector<std::string>().swap(nodes_);
    return std::make_unique<ArmedWatch>(backend_.connection(), std::move(leases_watch_), std::move(wake));
  }
  std::unique_ptr<BackendHold> hold(std::shared_ptr<LossSignal> loss) override {
    return queue_step([&] {
      leases_watch_.reset();
      auto& session = *session_;
      const auto bound = backend_.call_bound(session, deadline_);
      std::vector<std::string> created;
      const int rc = session.multi(admission(), bound, &created);
      if (rc == ZOK) return make_hold(std::move(created), bound, loss);
      if (rc == ZBADVERSION) throw QueueChanged{};  // someone else recorded a limit meanwhile
      if (rc == ZNONODE) {
        backend_.ensure_path(session, leases_, bound);  // the empty container was reaped
        throw QueueChanged{};
      }
      check_session(session, rc);
      if (!connection_trouble(rc)) throw_error("lease of '" + path_ + "'", rc);
      return hold_after_lost_reply(bound, loss);
    });
  }

 private:
  Standing look_in_line(std::size_t entries, const CallBudget& bound) {
    Standing standing;
    standing.entries.assign(entries, {EntryKind::exclusive, 1});
    if (!limit_checked_) {
      // Queued behind others: a disagreeing limit is refused now rather than after the wait.
      limit_checked_ = true;
      const auto data = backend_.read(*session_, path_, false, bound);
      const auto limit = data ? recorded_limit(*data) : std::nullopt;
      if (limit && *limit != request_.limit && !backend_.list(*session_, leases_, false, bound).empty()) {
        standing.mode = QueueMode::semaphore;
        standing.limit = *limit;
      }
    }
    return standing;
  }
  Standing look_at_head(const CallBudget& bound) {
    Stat stat{};
    const auto data = backend_.read(*session_, path_, false, bound, &stat);
    if (!data) throw QueueEntryGone{};  // the parent of our line cannot be gone while we live
    recorded_ = recorded_limit(*data);
    version_ = stat.version;
    leases_watch_.reset();
    if (!try_once_) leases_watch_ = std::make_unique<PathWatch>(backend_.connection(), leases_);  // before the read
    const auto held =
        static_cast<std::int64_t>(sorted_entries(backend_.list(*session_, leases_, !try_once_, bound)).size());
    Standing standing;
    if (held > 0 && recorded_) {
      standing.mode = QueueMode::semaphore;
      standing.limit = *recorded_;
    }
    // More leases held than our limit allows: someone with a larger limit took them (Curator's
    // InterProcessSemaphoreV2 records no limit and checks none). Contenders that agree with us
    // cannot get here: only the head of the line adds leases, within its limit (turnstile: in
    // the transaction that leaves the line; Curator: its lease node exists before its count
    // check only while it heads the line), and we are the head now. Waiting would starve us
    // silently behind a disagreement, so refuse it as a recorded one is refused. (One blind
    // spot: a Curator contender that timed out during a connection loss retries the deletes of
    // its lease and of its line node in the background, in either order.)
    if (held > request_.limit) {
      throw LimitMismatch("Semaphore '" + request_.name + "' has " + std::to_string(held) +
                          " leases held, more than this contender's limit " + std::to_string(request_.limit) +
                          ": another contender (e.g. Curator's InterProcessSemaphoreV2) uses a larger limit");
    }
    standing.entries.assign(static_cast<std::size_t>(held), {EntryKind::lease, 1});
    standing.entries.push_back({EntryKind::lease, request_.permits});
    return standing;
  }
  // One transaction: record the limit (if it changes), add our leases, leave the line. Nothing
  // half-done can leak (CURATOR-315 and kin).
  std::vector<Session::Op> admission() const {
    std::vector<Session::Op> ops;
    ops.reserve(static_cast<std::size_t>(request_.permits) + 2);
    if (recorded_ != request_.limit) {
      ops.push_back(Session::Op::set(path_, "limit=" + std::to_string(request_.limit), version_));
    }
    for (std::int64_t i = 0; i < request_.permits; ++i) {
      ops.push_back(Session::Op::create(lease_prefix_, data_, ZOO_EPHEMERAL_SEQUENTIAL));
    }
    ops.push_back(Session::Op::remove(parent_ + "/" + node_));
    return ops;
  }
  // The admission's reply was lost: it was applied iff our place in line is gone (and our
  // leases exist). "Gone" only on the server's word (after a sync), never on a failed look.
  std::unique_ptr<BackendHold> hold_after_lost_reply(const CallBudget& bound, std::shared_ptr<LossSignal>& loss) {
    auto& session = *session_;
    // Whatever it made of ours is removed once the connection is back (the line node by
    // leave()), never left to hold for nobody.
    const auto orphan_leases = [&] { backend_.remove_later({session.weak_from_this(), "", leases_, uuid_}); };
    const auto applied = backend_.gone(session, parent_ + "/" + node_, bound);
    if (!applied) {
      orphan_leases();
      unconfirmed("the leases of '" + request_.name + "'", "any it made are removed once the connection is back");
    }
    if (!*applied) throw QueueChanged{};  // still heading the line
    std::vector<std::string> paths;
    try {
      for (const auto& lease : sorted_entries(backend_.list(session, leases_, false, bound))) {
        if (lease.uuid == uuid_) paths.push_back(leases_ + "/" + lease.node);
      }
    } catch (const BackendUnavailable&) {
      orphan_leases();
      throw;
    }
    if (paths.empty()) throw QueueEntryGone{};  // our line node was removed under us
    return make_hold(std::move(paths), bound, loss);
  }
  // Our lease nodes become the hold, with the token of the transaction that made them all (one
  // more call: a multi's answer carries no Stat).
  std::unique_ptr<BackendHold> make_hold(std::vector<std::string> paths, const CallBudget& bound,
                                         std::shared_ptr<LossSignal>& loss) {
    left_ = true;  // the transaction left the line
    const Orphan leases{session_->weak_from_this(), "", leases_, uuid_};
    std::uint64_t token = 0;
    try {
      token = backend_.read_token(*session_, paths.front(), bound, leases);
    } catch (const QueueEntryGone&) {
      backend_.remove_later(leases);  // one was removed under us: the others go too
      throw;
    }
    return std::make_unique<ZookeeperHold>(backend_, session_, std::move(paths), token, std::move(loss));
  }

  std::string leases_;
  std::string lease_prefix_;
  bool try_once_;
  Deadline deadline_;                     // the last look's: the admission's calls are bounded by it
  std::optional<std::int64_t> recorded_;  // the limit recorded when we last looked from the head
  int version_ = -1;                      // of the name's node then
  std::unique_ptr<PathWatch> leases_watch_;
  bool lock_checked_ = false;
  bool limit_checked_ = false;
};

}  // namespace

std::unique_ptr<EntryPlace> make_lease_place(ZookeeperBackend& backend, std::shared_ptr<Session> session,
                                             const QueueRequest& request, bool try_once) {
  return std::make_unique<LeasePlace>(backend, std::move(session), request, try_once);
}

}  // namespace turnstile::detail::zookeeper
