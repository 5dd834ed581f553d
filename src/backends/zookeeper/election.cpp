// SPDX-License-Identifier: Apache-2.0
// Elections in Curator LeaderLatch's layout (nodes.hpp): a leader's proclaim, and what wakes an
// observer. Candidates join and lead through LockPlace (lock_place.cpp), as a Mutex does.
#include <condition_variable>
#include <mutex>

#include "backends/zookeeper/zookeeper_backend.hpp"

namespace turnstile::detail::zookeeper {

namespace {

// The first LeaderLatch node after `node` among `children`. Curator's LeaderLatch watches the
// latch node just ahead of its own (other nodes sort after every latch node in its order), and
// acts only on NodeDeleted (LeaderLatch.java:640): a data change on ours would cost it its watch,
// and it would never take over after we leave.
struct Behind {
  bool gone = false;      // `node` is not among them
  bool curator = false;   // the next latch node is not turnstile's (its protection uuid unmarked)
  std::string next = {};  // the next latch node, if any
};

Behind latch_behind(const std::vector<std::string>& children, const std::string& node) {
  const auto entries = sorted_entries(children);
  const auto me = index_of(entries, node);
  if (me == entries.size()) return {.gone = true};
  for (auto i = me + 1; i < entries.size(); ++i) {
    if (entries[i].latch) return {.curator = !is_marked(entries[i].uuid), .next = entries[i].node};
  }
  return {};
}

}  // namespace

void ZookeeperHold::proclaim(const std::string& value) {
  if (!election_) return BackendHold::proclaim(value);
  const auto& path = paths_.front();
  const auto parent = path.substr(0, path.rfind('/'));
  const auto node = path.substr(parent.size() + 1);
  const auto bound = session_->short_budget();
  const auto lost = [&](const std::string& why) {
    loss_->lose(why, LossCause::entry_gone);
    throw HoldLost("the leadership at '" + path + "' (fencing token " + std::to_string(token_) + ") was lost: " + why +
                   "; nothing was proclaimed");
  };
  // A write by someone else between our read and our set (by hand: nobody else writes our node),
  // or the candidate behind us leaving meanwhile, is read again, a few times at most.
  for (int attempt = 1;; ++attempt) {
    if (session_->expired()) lost("its ZooKeeper session expired");
    std::vector<std::string> children;
    Stat stat{};
    Behind behind;
    int rc = session_->children(parent, false, bound, &children);
    if (rc == ZOK) {
      behind = latch_behind(children, node);
      if (behind.gone) lost("its node is gone");
      if (behind.curator) {
        throw InvalidArgument("proclaim at '" + path +
                              "' refused: a Curator LeaderLatch is next in line, and it ignores a changed "
                              "value (it would stop watching and never take over); nothing was proclaimed");
      }
      rc = session_->exists(path, false, bound, &stat);
    }
    // Versioned: written only over the data we read, so a set is applied at most once. With our
    // candidate behind checked in the same transaction: if it left meanwhile, a Curator latch
    // behind it may watch our node now, and nothing is written (read again).
    if (rc == ZOK) {
      rc = behind.next.empty() ? session_->set(path, value, stat.version, bound)
                               : session_->multi({Session::Op::check(parent + "/" + behind.next),
                                                  Session::Op::set(path, value, stat.version)},
                                                 bound);
    }
    if (rc == ZOK) return;
    if (session_gone(rc)) lost("its ZooKeeper session expired");
    // Our node gone, or (in the transaction) the one behind it: read again to tell which.
    const bool behind_left = rc == ZNONODE && !behind.next.empty();
    if ((rc == ZBADVERSION || behind_left) && attempt < 5) continue;
    if (behind_left) {
      throw BackendUnavailable("proclaim at '" + path +
                               "': the candidates behind it kept leaving; nothing was proclaimed");
    }
    if (rc == ZNONODE) lost("its node is gone");
    if (connection_trouble(rc)) {
      throw BackendUnavailable("the value at '" + path + "' may not have changed (" + zerror(rc) +
                               "); it is the old value or the new one, nothing else");
    }
    throw_error("proclaim at '" + path + "'", rc);
  }
}

namespace {

// What wakes an election's observer: a child watch on the name's node (a candidate joined or
// left: the head may have changed) and a data watch on the head's node (a proclaim), set again
// after every wake before the core reads the leader, so no change between two reads is missed.
// The first wait only sets them (the core's first read came before). No thread of its own: the
// observer's thread sleeps on a Waiter, woken by the watches or any session event. While the
// server cannot be reached it polls (every Backend::kLeaderPoll).
class ZookeeperLeaderWatch final : public LeaderWatch {
 public:
  ZookeeperLeaderWatch(ZookeeperBackend& backend, std::string path) : backend_(backend), path_(std::move(path)) {}
  ~ZookeeperLeaderWatch() override { forget(); }

  void wait(Deadline deadline, const std::stop_token& stop) override {
    const CallBudget caller(deadline, stop);
    if (armed_ && !backend_.connection().sleep(waiter_, caller)) {
      if (caller.stopped()) armed_ = false;  // the stop may have taken an event's wake: set afresh next time
      return;                                // the deadline or a stop
    }
    armed_ = false;
    try {
      watch_again(caller);
      armed_ = true;
    } catch (const CallStopped&) {
    } catch (const SessionGone&) {
      pause(caller);
    } catch (const BackendUnavailable&) {
      pause(caller);
    }
  }

 private:
  void watch_again(const CallBudget& caller) {
    forget();
    auto session = backend_.session_for(caller);
    const auto bound = backend_.call_bound(*session, caller);
    // Registered before the calls that set the server's watches: no event between is missed.
    watch(path_);
    const auto entries = sorted_entries(backend_.list(*session, path_, true, bound));
    if (entries.empty()) {
      // The name's node may be missing (no child watch is left then): watch for its creation.
      const int rc = session->exists(path_, true, bound);
      if (rc != ZOK && rc != ZNONODE) {
        check_session(*session, rc);
        give_up(bound, "watch of '" + path_ + "'", rc);
      }
      return;
    }
    const auto head = path_ + "/" + entries.front().node;
    watch(head);
    backend_.read(*session, head, true, bound);  // gone meanwhile: the child watch fired already
  }
  void watch(const std::string& path) {
    backend_.connection().watch(path, &waiter_);
    watched_.push_back(path);
  }
  void forget() {
    for (const auto& path : watched_) backend_.connection().unwatch(path, &waiter_);
    watched_.clear();
  }
  // The server did not answer: the next wait tries again after a poll period.
  static void pause(const CallBudget& caller) {
    auto until = SteadyClock::now() + Backend::kLeaderPoll;
    if (caller.deadline()) until = std::min(until, *caller.deadline());
    std::mutex mutex;
    std::condition_variable_any never;
    std::unique_lock lock(mutex);
    never.wait_until(lock, caller.stop(), until, [] { return false; });
  }

  ZookeeperBackend& backend_;
  std::string path_;
  Waiter waiter_;
  std::vector<std::string> watched_;
  bool armed_ = false;
};

}  // namespace

std::unique_ptr<LeaderWatch> ZookeeperBackend::watch_leader(const std::string& name) {
  return std::make_unique<ZookeeperLeaderWatch>(*this, path_of(name));
}

}  // namespace turnstile::detail::zookeeper
