// SPDX-License-Identifier: Apache-2.0
// Leader elections on Consul (election.cpp): the Mutex's layout with the leader's value in the
// api.Lock key NAME, as Consul's leader-election guide describes it. Candidates queue FIFO as a
// Mutex's contenders do (turnstile/q/<NAME>/), each entry marked an election's with its
// proposal; the head leads once it holds NAME (?acquire with its session), whose Value is the
// leader's value. Peers that follow the guide (python-consul, curl: Flags 0) or use api.Lock
// (Flags LockFlagValue) poll or watch NAME and race in when it has no Session; Consul's acquire
// arbitrates. NAME without a Session (or absent) means "no leader", as the guide says.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "backends/consul/keys.hpp"
#include "backends/consul/queue_view.hpp"
#include "core/backend.hpp"
#include "core/queue.hpp"

namespace turnstile::detail::consul {

class ConsulBackend;

// What a leader-election guide's candidate writes as Flags (python-consul and curl send none).
constexpr std::uint64_t kGuideFlags = 0;

// The Value the queue's head writes into NAME when it takes it: an election candidate's proposal,
// "" for a lock (what a Mutex has always written).
std::string lock_key_value(const QueueRequest& request);
// The mode an entry of our queue gives its name.
QueueMode queue_mode_of(const QueuedEntry& entry);
// The mode NAME gives the name for `request` when it is held by a session our queue's head does
// not have (`foreign`); none when it is released or held by our head (then our entries say).
// Throws KindMismatch when its flags are someone else's: a lock accepts only api.Lock's, an
// election api.Lock's and the guide's (0).
QueueMode lock_key_mode(const QueueRequest& request, const KvEntry& key, bool foreign);
// What inspect calls a name whose NAME is held by a peer and that has no turnstile entry: an
// election when the key has the guide's flags or a value (api.Lock with opts.Value: a leader's),
// else a lock; "" when the key is no api.Lock or guide key.
std::string peer_key_mode(const KvEntry& key);

// The leader key as its hold last wrote it: what a proclaim checks and rewrites.
struct LeaderKey {
  std::string name;
  std::string session_id;
  std::string entry_key;
  std::uint64_t index = 0;  // NAME's ModifyIndex after our last write (0: not known, read it)
  std::string value;        // NAME's Value then
};

// A leader's proclaim (BackendHold::proclaim), one at a time per hold.
class Proclaimer {
 public:
  explicit Proclaimer(LeaderKey key) : key_(std::move(key)) {}
  // Rewrites NAME's Value under our session, by one transaction that checks that our entry is
  // still our session's and that NAME is as we last wrote it (so each proclaim applies at most
  // once, and a copy of an earlier one delivered late finds NAME moved on). False when the
  // entry or the key is no longer ours (nothing written). Throws BackendUnavailable when the
  // outcome is unknown: a background write then moves NAME's index on (same value) so that a
  // copy still on its way changes nothing.
  bool proclaim(ConsulBackend& backend, const std::string& value);

 private:
  bool read_key(ConsulBackend& backend);
  void retire_later(ConsulBackend& backend);

  std::mutex mutex_;
  LeaderKey key_;
};

std::unique_ptr<LeaderWatch> make_leader_watch(ConsulBackend& backend, const std::string& name);

}  // namespace turnstile::detail::consul
