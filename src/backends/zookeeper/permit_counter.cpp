// SPDX-License-Identifier: Apache-2.0
#include <optional>
#include <utility>

#include "backends/zookeeper/counts.hpp"
#include "backends/zookeeper/zookeeper_backend.hpp"

namespace turnstile::detail::zookeeper {

namespace {

// ---- PermitCounter ----
//
// The count is the text of ROOT/NAME/permits, changed only by a transaction that names the
// version it read (compare-and-set) and makes a marker node of its own (change_count), so a
// change whose reply was lost is known to have happened or not. Waiters line up as ephemeral
// sequential nodes in ROOT/NAME/permit-waiters; the head watches the count, the others their
// predecessor.

// The answer of change_count when a change whose reply was lost turned out not applied: the
// caller looks again, as after losing a race.
constexpr int kNotApplied = ZBADVERSION;
// The answer of change_count when the outcome stayed unknown and the caller resolves it.
constexpr int kOutcomeUnknown = ZOPERATIONTIMEOUT;

// One PermitCounter acquire: outside the line, then (once it has to wait) with a node in it.
// Every call ends on the caller's stop (the core then gives up and leaves).
class PermitLine final : public CounterLine {
 public:
  PermitLine(ZookeeperBackend& backend, const std::string& name, std::int64_t permits, std::stop_token stop)
      : backend_(backend), name_(name), permits_(permits), count_path_(backend.path_of(name) + "/permits"),
        line_(backend.path_of(name) + "/permit-waiters"), stop_(std::move(stop)) {}

  CounterStanding look(bool last_try, Deadline deadline) override {
    return queue_step([&] {
      auto& session = this->session(deadline);
      const auto bound = backend_.call_bound(session, {deadline, stop_});
      CounterStanding standing;
      standing.in_line = !node_.empty();
      const auto line = sorted_entries(backend_.list(session, line_, false, bound));
      standing.ahead = standing.in_line ? index_of(line, node_) : line.size();
      if (standing.in_line && standing.ahead == line.size()) throw QueueEntryGone{};
      if (standing.ahead > 0) {
        predecessor_ = line[standing.ahead - 1].node;  // the count does not matter yet
        return standing;
      }
      read_count(standing.in_line && !last_try, bound);
      if (has_count_) standing.value = saturated(count_.value);
      return standing;
    });
  }
  bool take(const CounterStanding&, Deadline deadline) override {
    return queue_step([&] {
      if (stop_.stop_requested()) throw CallStopped{};  // nothing sent: nothing to find out
      auto& session = this->session(deadline);
      const auto bound = backend_.call_bound(session, {deadline, stop_});
      require_exact(count_, name_);
      const auto what = "PermitCounter::acquire(" + std::to_string(permits_) + ") of '" + name_ + "'";
      const auto left = Session::Op::set(count_path_, count_text(count_.value - permits_), version_);
      if (node_.empty()) {
        std::string marker;
        const int rc = backend_.change_count(session, count_path_, {left}, what, bound, &marker);
        if (rc == ZOK) return true;
        if (rc == kNotApplied || rc == ZNONODE) return false;
        if (rc == kOutcomeUnknown) {
          unconfirmed_take_ = {marker, false};  // leave() may still find out
          unconfirmed(what, "it may or may not have been applied");
        }
        throw_error("update of '" + count_path_ + "'", rc);
      }
      // Take them and leave the line in one transaction.
      const int rc = session.multi({left, Session::Op::remove(line_ + "/" + node_)}, bound);
      if (rc == ZOK || rc == ZBADVERSION) {
        if (rc == ZOK) node_.clear();
        return rc == ZOK;
      }
      check_session(session, rc);
      if (!connection_trouble(rc)) throw_error("update of '" + count_path_ + "'", rc);
      // Unknown outcome: applied iff our place in line is gone, on the server's word after a
      // sync (never resent: it could take the permits twice).
      const auto applied = backend_.gone(session, line_ + "/" + node_, bound);
      if (!applied) {
        unconfirmed_take_ = {line_ + "/" + node_, true};  // leave() may still find out
        unconfirmed(what, "it may or may not have been applied");
      }
      if (*applied) node_.clear();
      return *applied;
    });
  }
  void join(Deadline deadline) override {
    queue_step([&] {
      auto& session = this->session(deadline);
      const ZookeeperBackend::NewEntry entry{.parent = line_,
                                             .label = kWaitLabel,
                                             .uuid = random_uuid(),
                                             .data = node_data("permits", backend_.holder_label(), permits_)};
      node_ = backend_.create_entry(session, entry, backend_.call_bound(session, {deadline, stop_})).node;
    });
  }
  void wait(CounterWait wait, Deadline deadline, const std::stop_token& stop) override {
    queue_step([&] {
      if (wait == CounterWait::predecessor) {
        backend_.wait_for_change(*session_, line_ + "/" + predecessor_, {deadline, stop});
      } else if (count_watch_) {
        count_watch_->sleep({deadline, stop});
        check_session(*session_, ZOK);
      }
      count_watch_.reset();
    });
  }
  // wait() without a thread: the watch of the predecessor's node or of the count (set by the
  // look) runs `wake` on the C client's event thread.
  std::unique_ptr<WakeArm> arm(CounterWait wait, Deadline, Wake wake) override {
    if (wait == CounterWait::predecessor) {
      return backend_.arm_on_change(*session_, line_ + "/" + predecessor_, std::move(wake));
    }
    // A watch the look could not set: no watch, i.e. a wake at once (the next look sets it).
    if (!count_watch_set_) count_watch_.reset();
    return std::make_unique<ArmedWatch>(backend_.connection(), std::move(count_watch_), std::move(wake));
  }
  bool leave() noexcept override {
    const bool taken = unconfirmed_take_ && resolve_take();
    if (!node_.empty()) backend_.remove_eventually(*session_, line_ + "/" + node_);
    node_.clear();
    return taken;
  }

 private:
  // A take whose reply was lost and whose outcome was still unknown when it gave up (its
  // deadline passed, or its stop came, before the session was back): whether it was applied,
  // on the server's word after one short wait for the connection and one for a read after a
  // sync (bounded: never the caller's stop, which may be what ended the take). Its evidence is
  // our node in line (the take removed it) or the take's marker (the take made it); the take
  // was sent on the old connection, so it cannot be applied after that read. False when still
  // unknown (the session expired, taking the evidence with it, or no answer in time): the
  // marker goes to the background removal.
  bool resolve_take() noexcept {
    const auto take = std::exchange(unconfirmed_take_, std::nullopt);
    auto& session = *session_;
    std::optional<bool> absent;
    try {
      if (backend_.connection().wait_connected(session, session.short_budget())) {
        absent = backend_.gone(session, take->path, session.short_budget());
      }
    } catch (...) {  // the session expired
    }
    const bool applied = absent && *absent == take->applied_if_gone;
    if (take->applied_if_gone) {
      if (applied) node_.clear();  // the take removed it
    } else if (!absent) {
      backend_.remove_later({session.weak_from_this(), take->path, "", ""});
    } else if (applied) {
      backend_.remove_eventually(session, take->path);
    }
    return applied;
  }
  Session& session(Deadline deadline) {
    if (!session_) session_ = backend_.session_for({deadline, stop_});
    return *session_;
  }
  // Reads the count (and its version) for the head of the line; `watch`: and watches it, or its
  // creation, for the wait.
  void read_count(bool watch, const CallBudget& bound) {
    count_watch_.reset();
    count_watch_set_ = true;
    if (watch) count_watch_ = std::make_unique<PathWatch>(backend_.connection(), count_path_);
    for (;;) {
      Stat stat{};
      const auto text = backend_.read(*session_, count_path_, watch, bound, &stat);
      has_count_ = text.has_value();
      count_ = text ? count_of(*text, name_) : Count{};
      version_ = stat.version;
      if (text || !watch) return;
      const int rc = session_->exists(count_path_, true, bound);  // a watch for its creation
      check_session(*session_, rc);
      if (rc != ZOK) {
        // Still missing; or no answer: a sleeping thread is still woken by the session's events,
        // an armed wake runs at once (see arm).
        count_watch_set_ = rc == ZNONODE;
        return;
      }
    }
  }

  ZookeeperBackend& backend_;
  std::string name_;
  std::int64_t permits_;
  std::string count_path_;
  std::string line_;
  std::shared_ptr<Session> session_;  // the live one at the first call
  std::string node_;                  // ours in line, "" outside it
  std::string predecessor_;           // the last look's waiter just ahead
  bool has_count_ = false;            // the last look's count, as read from the head
  Count count_;
  int version_ = -1;
  std::unique_ptr<PathWatch> count_watch_;
  bool count_watch_set_ = true;  // the server's watch for it is set (else no answer came)
  std::stop_token stop_;         // the caller's
  struct UnconfirmedTake {
    std::string path;      // the node whose presence tells
    bool applied_if_gone;  // our node in line; else the take's marker (applied if present)
  };
  std::optional<UnconfirmedTake> unconfirmed_take_;
};

}  // namespace

std::unique_ptr<CounterLine> ZookeeperBackend::counter_line(const std::string& name, std::int64_t permits,
                                                            const std::stop_token& stop) {
  return std::make_unique<PermitLine>(*this, name, permits, stop);
}

int ZookeeperBackend::change_count(Session& session, const std::string& count_path, std::vector<Session::Op> ops,
                                   const std::string& what, const CallBudget& bound, std::string* unresolved) {
  // The marker: an ephemeral child of the count's node, made by the same transaction, so that
  // after a lost reply its presence (read after a sync) says whether the change was applied.
  // Nobody else makes it (its name is random) and no name reaches it (a `permits` segment is
  // encoded). A value and version read back would not do: a peer that read the same version
  // may have written the same text.
  const auto marker = count_path + "/" + protected_name(random_uuid(), "change");
  ops.push_back(Session::Op::create(marker, "", ZOO_EPHEMERAL));
  const int rc = session.multi(ops, bound);
  if (rc == ZOK) {
    remove_eventually(session, marker);
    return ZOK;
  }
  check_session(session, rc);
  if (!connection_trouble(rc)) return rc;
  // Unknown outcome. Resent never (it could apply twice): decided by the marker, on the
  // server's word after a sync; the transaction cannot still be applied after that (a
  // session's requests are applied in order, and the old connection's are done before the
  // new one is served).
  const auto absent = gone(session, marker, bound);
  if (!absent && unresolved) {
    *unresolved = marker;  // not for the background yet: its removal would read as "not applied"
    return kOutcomeUnknown;
  }
  if (!absent) {
    remove_later({session.weak_from_this(), marker, "", ""});
    unconfirmed(what, "it may or may not have been applied");
  }
  if (*absent) return kNotApplied;
  remove_eventually(session, marker);
  return ZOK;
}

bool ZookeeperBackend::counter_try_set(const std::string& name, std::int64_t permits) {
  const auto deadline = call_deadline();
  auto session = session_for(deadline);
  const auto path = path_of(name) + "/permits";
  const auto what = "PermitCounter::try_set_permits(" + std::to_string(permits) + ") of '" + name + "'";
  return outside_queue("PermitCounter::try_set_permits (the change may or may not have been applied)", [&] {
    for (;;) {
      const int rc = change_count(*session, path, {Session::Op::create(path, std::to_string(permits), ZOO_PERSISTENT)},
                                  what, deadline);
      if (rc == ZOK) return true;
      if (rc == ZNODEEXISTS) return false;
      if (rc == ZNONODE) ensure_path(*session, path_of(name), deadline);
      else if (rc != kNotApplied) throw_error("create of '" + path + "'", rc);
    }
  });
}

std::int64_t ZookeeperBackend::counter_add(const std::string& name, std::int64_t delta) {
  const auto deadline = call_deadline();
  auto session = session_for(deadline);
  const auto path = path_of(name) + "/permits";
  const auto what = "PermitCounter::add_permits(" + std::to_string(delta) + ") of '" + name + "'";
  return outside_queue("PermitCounter::add_permits (the change may or may not have been applied)", [&] {
    for (;;) {
      Stat stat{};
      const auto text = read(*session, path, false, deadline, &stat);
      const Count count = text ? count_of(*text, name) : Count{};
      require_exact(count, name);
      const __int128 sum = count.value + delta;  // no overflow: |value| < 10^38, |delta| <= 10^12
      // A change may not take the count further beyond +-max_permits; one that moves it back
      // toward that range is always allowed, so a count a peer pushed beyond it never wedges.
      if ((delta > 0 && sum > max_permits) || (delta < 0 && sum < -max_permits)) {
        throw InvalidArgument("PermitCounter '" + name + "': adding " + std::to_string(delta) + " to " +
                              count_text(count.value) + " would take it beyond +-" + std::to_string(max_permits) +
                              "; nothing changed");
      }
      const auto op = text ? Session::Op::set(path, count_text(sum), stat.version)
                           : Session::Op::create(path, count_text(sum), ZOO_PERSISTENT);
      const int rc = change_count(*session, path, {op}, what, deadline);
      if (rc == ZOK) return saturated(sum);
      if (rc == ZNONODE && !text) ensure_path(*session, path_of(name), deadline);
      else if (rc != kNotApplied && rc != ZNODEEXISTS && rc != ZNONODE) throw_error("update of '" + path + "'", rc);
    }
  });
}

std::optional<std::int64_t> ZookeeperBackend::counter_get(const std::string& name) {
  const auto deadline = call_deadline();
  return outside_queue("PermitCounter::available_permits", [&]() -> std::optional<std::int64_t> {
    for (;;) {
      auto session = session_for(deadline);
      try {
        const auto text = read(*session, path_of(name) + "/permits", false, deadline);
        if (!text) return std::nullopt;
        return saturated(count_of(*text, name).value);
      } catch (const SessionGone&) {
        if (passed(deadline)) throw;  // a read changes nothing: asked again on the new session until then
      }
    }
  });
}

std::int64_t ZookeeperBackend::counter_drain(const std::string& name) {
  const auto deadline = call_deadline();
  auto session = session_for(deadline);
  const auto path = path_of(name) + "/permits";
  const auto what = "PermitCounter::drain_permits() of '" + name + "'";
  return outside_queue(
      "PermitCounter::drain_permits (the change may or may not have been applied)", [&]() -> std::int64_t {
        for (;;) {
          Stat stat{};
          const auto text = read(*session, path, false, deadline, &stat);
          if (!text) return 0;
          const auto count = count_of(*text, name);  // any number: draining resets even a peer's huge count
          const int rc = change_count(*session, path, {Session::Op::set(path, "0", stat.version)}, what, deadline);
          if (rc == ZOK) return saturated(count.value);
          if (rc != kNotApplied && rc != ZNONODE) throw_error("update of '" + path + "'", rc);
        }
      });
}

}  // namespace turnstile::detail::zookeeper
