// SPDX-License-Identifier: Apache-2.0
// What the Redis backend calls: one Connection (redis://, redis+sentinel://), or with
// redis+cluster:// a small cluster client of turnstile's own (Debian's hiredis 0.14 has none):
// the slot map from CLUSTER SLOTS, one Connection per node, each call routed by its first key's
// slot, MOVED followed (the map is read again), ASK followed once (ASKING + the call on the named
// node), CLUSTERDOWN/TRYAGAIN and unreachable nodes retried, all by the call's deadline.
//
// Every key of a name shares one hash tag (one slot), so every script runs on one node.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "backends/redis/connection.hpp"
#include "core/deadline_mutex.hpp"

namespace turnstile::detail::redis {

inline constexpr int kClusterSlots = 16384;

// The slot of a key: CRC16 (XMODEM) of its hash tag (what stands between its first '{' and the
// next '}', when not empty; else the whole key), modulo 16384.
int key_slot(std::string_view key);

// A short hash tag whose keys land in `slot`: the smallest decimal number that hashes there.
// For keys that must share a slot with a key whose own text cannot serve as their tag.
std::string tag_for_slot(int slot);

class Router {
 public:
  // With a cluster, reads the slot map now (one pass over the URL's nodes, by connect_by or the
  // connect timeout), so a bad URL, password or a server that is no cluster fails at once.
  // on_server_changed(server) as for Connection; with a cluster also ("") when the slot map
  // changed (a failover, a resharding).
  // With `map_from` (another router of the same URL), its slot map is taken instead.
  Router(Settings settings, std::vector<const Script*> scripts,
         std::function<void(const std::string& server)> on_server_changed,
         std::chrono::milliseconds max_backoff = kMaxReconnectBackoff, Router* map_from = nullptr);
  ~Router();
  Router(const Router&) = delete;
  Router& operator=(const Router&) = delete;

  // As Connection's, on the node serving keys.front()'s slot. `server` receives the node's
  // identity (Opened::server).
  // (options.asking is the router's own.)
  Reply eval(const Script& script, const std::vector<std::string>& keys, const std::vector<std::string>& args,
             const CallOptions& options);
  // As Connection's, without a cluster; with one, false (the caller calls eval()).
  bool send_pipelined(const Script& script, const std::vector<std::string>& keys, const std::vector<std::string>& args,
                      Answer answer) {
    return single_ && single_->send_pipelined(script, keys, args, std::move(answer));
  }
  void collect_pending(SteadyClock::time_point until) {
    if (single_) single_->collect_pending(until);
  }
  // As Connection's: one round trip per node; each Result says which server answered it.
  std::vector<Result> eval_each(const std::vector<ScriptCall>& calls, const CallBudget& budget);
  std::vector<Reply> eval_pipelined(const std::vector<ScriptCall>& calls, const CallBudget& budget);
  // A plain command on the node serving `key` (any node for "").
  Reply command(const Command& command, const CallBudget& budget, const std::string& key = {});
  // As Connection's; with a cluster, only sleeps until `until` or `wake_fd` (false).
  bool watch_idle(SteadyClock::time_point until, int wake_fd);
  // Sentinels only (see Connection).
  void follow(const std::string& server);
  bool primary_moved(const std::string& address);

  const Settings& settings() const { return settings_; }
  // With a cluster: reads the slot map again, from the nodes in turn, by `until`. False when no
  // node answered. Calls on_server_changed("") when the map changed.
  // `failures` (optional) receives why each node asked did not answer. At connect (no map yet)
  // a server that is no cluster node fails the call with BackendUnavailable, saying so; later
  // such a server is passed over.
  bool refresh(SteadyClock::time_point until, const std::stop_token& stop = {}, std::string* failures = nullptr);
  // With a cluster: the nodes a subscriber may listen on, the best first: the primaries the map
  // has serve slots, then the URL's other nodes (never one that said it is no cluster node).
  std::vector<SentinelAddress> listening_nodes();
  // With a cluster: host:port of the node serving `key`'s slot by the map ("" when unknown).
  std::string owner(const std::string& key);
  // With a cluster: whether the map has `address` (host:port) serve any slot. A primary demoted
  // by a failover, or gone, serves none; one that gave a slot away to a resharding serves others.
  bool serves_slots(const std::string& address);
  // With a cluster: whether a connection to `address` (host:port) was ever made here.
  bool knows_node(const std::string& address);
  // The primaries serving slots (the map read first when there is none yet), for a call every
  // primary must answer (SCAN); without a cluster, one "" for the one server.
  std::vector<std::string> primaries(const CallBudget& budget);
  // A plain command on the primary at `address` (one of primaries()), not redirected.
  Reply command_at(const std::string& address, const Command& command, const CallBudget& budget);

 private:
  Connection& node(const std::string& address);
  // The nodes to ask for the slot map, in this pass's order.
  std::vector<std::string> map_sources();
  // Why `address` did not give its slot map (its error reply `error`); see refresh().
  std::string refused_slot_map(const std::string& address, const std::exception_ptr& error);
  // Takes a slot map read from a node; true when it differs from the one before (not the first).
  bool adopt_map(std::vector<int> slots, std::vector<std::string> addresses);
  // refresh() by the deadline, at most a connect timeout.
  void refresh_by(const CallBudget& budget);
  // The node serving `slot`, by the map (reading it again when it names none).
  std::string owner_of(int slot, const CallBudget& budget);
  // One try of a call on a node: its share of the budget, and whether to send ASKING first.
  using Attempt = std::function<Result(Connection& node, const CallBudget& share, bool asking)>;
  // Runs `attempt` (a Result: an error reply inside, a failed connection thrown) on the node
  // serving `slot`, following redirections, and outages when the call is idempotent.
  Result routed(int slot, const CallBudget& budget, bool idempotent, const Attempt& attempt);

  const Settings settings_;
  const std::vector<const Script*> scripts_;
  const std::function<void(const std::string&)> on_server_changed_;
  const std::chrono::milliseconds max_backoff_;
  std::unique_ptr<Connection> single_;  // redis://, redis+sentinel://

  DeadlineMutex refreshing_;            // one refresh at a time
  std::mutex mutex_;                    // guards what follows; never held across network I/O
  std::vector<int> slots_;              // node index by slot, -1 when unknown
  std::vector<std::string> addresses_;  // node index -> host:port (the host unbracketed, as MOVED writes it)
  std::map<std::string, std::unique_ptr<Connection>> nodes_;  // never erased: references stay valid
  std::size_t next_seed_ = 0;                                 // where the next refresh starts asking
  std::set<std::string> strangers_;                           // host:port of servers that said they are no cluster node
  SteadyClock::time_point refreshed_at_{};
};

}  // namespace turnstile::detail::redis
