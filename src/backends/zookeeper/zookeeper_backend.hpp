// SPDX-License-Identifier: Apache-2.0
// The ZooKeeper backend: storage for the core's queue loop in Curator 5's node layout, so
// turnstile and Curator contenders on one path exclude each other in one FIFO queue.
//
// Where things are:
//   nodes.*            the node layout: names to paths, entries' names, node data, tokens
//   counts.*           a PermitCounter's count as its node's text holds it
//   errors.*           ZooKeeper's answers as turnstile's typed errors (the one place)
//   settings.*, timeouts.hpp   the URL's settings and the backend's fixed waits
//   session.*          one ZooKeeper session: the calls, waited for on the caller's thread
//   connection.*       the current session, the keeper (loss), the watches
//   removals.*         nodes of ours to remove in the background (the core's GuaranteedRemoval)
//   zookeeper_backend.cpp   the node operations every place uses, join, the factory
//   places.hpp, lock_place.cpp, lease_place.cpp   a contender's place in a queue
//   hold.cpp           a hold's nodes: downgrade, release
//   permit_counter.cpp the PermitCounter: its line and its count's changes
//   inspect.cpp        inspect()
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "backends/zookeeper/connection.hpp"
#include "backends/zookeeper/errors.hpp"
#include "backends/zookeeper/nodes.hpp"
#include "backends/zookeeper/removals.hpp"
#include "backends/zookeeper/timeouts.hpp"
#include "core/backend.hpp"

namespace turnstile::detail::zookeeper {

class ZookeeperBackend;

class ZookeeperHold final : public BackendHold {
 public:
  ZookeeperHold(ZookeeperBackend& backend, std::shared_ptr<Session> session, std::vector<std::string> paths,
                std::uint64_t token, std::shared_ptr<LossSignal> loss, bool election = false);
  ~ZookeeperHold() override;

  std::uint64_t fencing_token() const override { return token_; }
  void downgrade() override;
  // An election leader's new value (election.cpp): setData at the version just read, refused
  // while a node that is not turnstile's is directly behind ours (a Curator LeaderLatch there
  // drops its watch on a data change, LeaderLatch.java:640, and would never take over).
  void proclaim(const std::string& value) override;
  void release() override;
  // A single node on a connected session: its deletion is sent and `done` runs on the keeper's
  // thread when answered. Several lease nodes, an earlier unconfirmed attempt or a connection
  // that is down: release(), then `done`.
  void release_pipelined(ReleaseDone done) override;
  // "zk1 <session id in hex> <path>...": the nodes and the session that owns them.
  std::string receipt() const override;

 private:
  ZookeeperBackend& backend_;
  std::shared_ptr<Session> session_;
  std::vector<std::string> paths_;  // our nodes: one entry, or one lease node per permit
  std::uint64_t token_;
  std::shared_ptr<LossSignal> loss_;
  std::shared_ptr<ServerLease> lease_;  // the session's, when the hold was made
  bool election_;                       // a LeaderLatch node: proclaim rewrites its data
  bool released_ = false;
  bool unconfirmed_release_ = false;  // a release attempt's outcome was unknown
  // What a release's answer `rc` means: released (the loss told when the session is gone), or
  // throws BackendUnavailable (tried again later) or the server's error.
  void settle_release(int rc);
};

// Storage for the core's queue loop: join makes our entry node and hands out its place (below);
// the storage calls here retry over connection losses and throw SessionGone.
class ZookeeperBackend final : public Backend {
 public:
  explicit ZookeeperBackend(Settings settings) : connection_(std::move(settings)) {}

  std::unique_ptr<QueuePlace> join(const QueueRequest& request, bool try_once, Deadline deadline,
                                   Standing& first) override;
  bool has_elections() const override { return true; }  // Curator LeaderLatch's nodes (lock_place.cpp)
  // An observer wakes on the name's child watch and its head's data watch (election.cpp).
  std::unique_ptr<LeaderWatch> watch_leader(const std::string& name) override;
  std::unique_ptr<CounterLine> counter_line(const std::string& name, std::int64_t permits,
                                            const std::stop_token& stop) override;
  Inspection inspect(const std::string& name, Deadline deadline) override;
  QueueNames queue_names(const std::string& prefix, std::size_t max_names, Deadline deadline) override;
  bool counter_try_set(const std::string& name, std::int64_t permits) override;
  std::int64_t counter_add(const std::string& name, std::int64_t delta) override;
  std::optional<std::int64_t> counter_get(const std::string& name) override;
  std::int64_t counter_drain(const std::string& name) override;
  bool release_receipt(const std::string& receipt, Deadline deadline) override;  // hold.cpp

  Connection& connection() { return connection_; }
  // Hands nodes of ours to the background removal (see Orphan). Never blocks.
  void remove_later(Orphan orphan) {
    removal_.add(describe(orphan), [orphan = std::move(orphan)] { return remove_orphan(orphan); });
  }
  const std::string& holder_label() const { return connection_.settings().holder_label; }
  std::shared_ptr<Session> session_for(const CallBudget& caller) { return connection_.session(caller); }
  // Under a chroot, the chroot's segments are the first ones of every name: the chroot "/app"
  // and the name "x" make the node of the name "app/x" (so "lock-0000000000" under "/app" is
  // app/%6Cock-0000000000, never an entry of the name "app").
  std::string path_of(const std::string& name) const {
    const auto& root = connection_.settings().root;
    return "/" + encode_name(root.empty() ? name : root.substr(root.front() == '/' ? 1 : 0) + "/" + name);
  }
  // The bound of a step's calls. A step must reach the server once whatever the deadline (a
  // join, the look that decides a try-once acquire): at least a short wait from now, so a
  // deadline that is near or past is a timeout judged on the server's answer, not trouble.
  // And never more than a call without a deadline waits (call_deadline), however far the
  // deadline: a step that gets no answer reports trouble rather than hang. The caller's stop ends it.
  CallBudget call_bound(const Session& session, const CallBudget& caller) const {
    return caller.for_call({.floor = session.short_wait(), .cap = call_limits().cap});
  }
  // How a call without a deadline of its own is bounded: kZookeeperTimes.call, its cap raised to
  // a session timeout when that is longer.
  CallLimits call_limits() const {
    auto limits = kZookeeperTimes.call;
    limits.cap = std::max(limits.cap, connection_.settings().session_timeout);
    return limits;
  }

  // Creates every missing node of `path` (and `path` itself) as a container.
  void ensure_path(Session& session, const std::string& path, const CallBudget& bound);
  // A queue entry to make: PARENT/_c_<uuid>-<label><seq>, with `data`.
  struct NewEntry {
    std::string parent{};
    std::string label{};
    std::string uuid{};  // its protection id
    std::string data{};
    bool want_token = false;
    bool want_listing = false;  // the parent's children, read in the create's round trip
  };
  // The entry made: its name (not path) and, with want_token, its fencing token (token_of);
  // with want_listing, the parent's children read after the create, when that read answered.
  struct MadeEntry {
    std::string node{};
    std::uint64_t token = 0;
    std::optional<std::vector<std::string>> listing{};
  };
  // Creates an ephemeral sequential entry. After a connection loss it looks for its own node by
  // the protection id.
  MadeEntry create_entry(Session& session, const NewEntry& entry, const CallBudget& bound);
  // The fencing token of our node `path`, read from the server. When the server cannot tell
  // within the bound, `orphan` (the node, or what else a hold without a token leaves) goes to
  // the background removal and it throws; QueueEntryGone when the node is gone.
  std::uint64_t read_token(Session& session, const std::string& path, const CallBudget& bound, const Orphan& orphan);
  // Reads, retried over connection losses.
  std::vector<std::string> list(Session& session, const std::string& path, bool watch, const CallBudget& bound);
  std::optional<std::string> read(Session& session, const std::string& path, bool watch, const CallBudget& bound,
                                  Stat* stat = nullptr);
  // Deletes a node of ours; when the connection is down, the background removal does it once it is back
  // (an entry we gave up on must never stay in line, CURATOR-678). Never blocks past one call.
  void remove_eventually(Session& session, const std::string& path) noexcept;
  // Whether a node of ours is gone, after a write whose reply was lost: read after a sync, so a
  // lagging ensemble member cannot answer from before the write. nullopt when the server did
  // not answer within the bound.
  std::optional<bool> gone(Session& session, const std::string& path, const CallBudget& bound);
  // Sleeps until `path` changes, the deadline or a stop. At once when the node is already gone
  // or `still_blocks` says its data (read with the watch, so no change is missed) no longer does.
  void wait_for_change(Session& session, const std::string& path, const CallBudget& caller,
                       bool (*still_blocks)(const std::string&) = nullptr);
  // wait_for_change without a thread: `wake` runs (on the C client's event thread) when `path`
  // changes, is gone already or no longer blocks, or the session ends. Never waits.
  std::unique_ptr<WakeArm> arm_on_change(Session& session, const std::string& path, Wake wake,
                                         bool (*still_blocks)(const std::string&) = nullptr);
  // Throws InvalidArgument when a lease request cannot be one ZooKeeper transaction.
  void check_lease_request(const QueueRequest& request, const std::string& lease_prefix, const std::string& lease_data);
  // One change of a PermitCounter's count (`ops`, to which it adds its marker): ZOK when
  // applied, kNotApplied (look again) or the server's refusal when not. When that is not known
  // within the bound: with `unresolved`, kOutcomeUnknown and the marker's path there (present:
  // applied) for the caller to resolve; without, the background removal removes the marker and
  // it throws BackendUnavailable.
  int change_count(Session& session, const std::string& count_path, std::vector<Session::Op> ops,
                   const std::string& what, const CallBudget& bound, std::string* unresolved = nullptr);

 private:
  // After a failed call: true when another attempt is worth it (connection trouble, and the
  // connection back within the bound). Throws SessionGone when the session is gone.
  bool retry_after(Session& session, int rc, const CallBudget& bound) {
    check_session(session, rc);
    if (!connection_trouble(rc) || bound.passed()) return false;
    // A short pause, then no call until the connection is back (a call made while it is down
    // waits inside the C client, past any deadline).
    std::this_thread::sleep_for(kRetryPause);
    return connection_.wait_connected(session, bound) && !bound.passed();
  }
  // For calls that have no deadline of their own (counters, inspect): see call_limits.
  Deadline call_deadline() const { return CallBudget().call_end(call_limits()); }
  std::optional<std::string> find_own(Session& session, const std::string& parent, const std::string& uuid,
                                      const CallBudget& bound);
  // ensure_path's one pass, top down: ZOK, or ZNONODE when a level above was reaped meanwhile.
  int create_levels(Session& session, const std::string& path, const CallBudget& bound);
  static constexpr int kPathPasses = 5;
  void inspect_lock(Session& session, const std::string& path, const std::vector<std::string>& children,
                    Inspection& result, Deadline deadline);
  void inspect_semaphore(Session& session, const std::string& path, Inspection& result, Deadline deadline);

  Connection connection_;
  std::atomic<bool> containers_supported_{true};
  std::atomic<bool> create2_supported_{true};
  // Last: its attempts use the connection's sessions, so it stops before the connection closes.
  GuaranteedRemoval removal_{kZookeeperTimes.background};
};

}  // namespace turnstile::detail::zookeeper
