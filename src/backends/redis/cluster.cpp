// SPDX-License-Identifier: Apache-2.0
#include "backends/redis/cluster.hpp"

#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <future>
#include <limits>
#include <set>
#include <utility>

namespace turnstile::detail::redis {
namespace {

using std::chrono::milliseconds;

// One node's share of a call: a node that does not answer must not use up the time a failover
// needs (the call then goes to the node the map names next).
constexpr milliseconds kNodeAttempt{1500};
// Between attempts after a node failed, or while the cluster says CLUSTERDOWN/TRYAGAIN.
constexpr milliseconds kRetryPause{100};
// The most redirections one call follows (a map in flux settles well within these).
constexpr int kMaxRedirects = 16;
// A map read this recently is not read again for another caller's failure.
constexpr milliseconds kMinRefreshInterval{50};
// The most a node asked for the map may take while others are left to ask: a healthy node
// answers a new connection's hello and CLUSTER SLOTS in a few round trips, and a SIGSTOPped one
// (or one behind a dead link) must not use up a fair share of a long connect timeout.
constexpr milliseconds kMapAttempt{500};

std::uint16_t crc16(std::string_view data) {
  std::uint16_t crc = 0;
  for (const unsigned char byte : data) {
    crc ^= static_cast<std::uint16_t>(byte << 8);
    for (int bit = 0; bit < 8; ++bit) {
      crc = (crc & 0x8000) ? static_cast<std::uint16_t>((crc << 1) ^ 0x1021) : static_cast<std::uint16_t>(crc << 1);
    }
  }
  return crc;
}

// One node's share of a call: kNodeAttempt at most, by the caller's deadline; a deadline
// already passed ("try once") stays passed: one attempt, within the connection's caps.
constexpr CallLimits kNodeShare{.floor = milliseconds(0), .cap = kNodeAttempt};

}  // namespace

int key_slot(std::string_view key) {
  if (const auto open = key.find('{'); open != std::string_view::npos) {
    if (const auto close = key.find('}', open + 1); close != std::string_view::npos && close > open + 1) {
      key = key.substr(open + 1, close - open - 1);
    }
  }
  return crc16(key) % kClusterSlots;
}

std::string tag_for_slot(int slot) {
  // Built once (every slot is reached by a number below 110,000: a few milliseconds), not per
  // call: a search for one slot took up to 5 ms.
  static const auto smallest = [] {
    constexpr auto kNone = std::numeric_limits<std::uint32_t>::max();
    std::vector<std::uint32_t> table(kClusterSlots, kNone);
    for (std::uint32_t number = 0, left = kClusterSlots; left > 0; ++number) {
      auto& entry = table[crc16(std::to_string(number)) % kClusterSlots];
      if (entry == kNone) {
        entry = number;
        --left;
      }
    }
    return table;
  }();
  return std::to_string(smallest.at(static_cast<std::size_t>(slot)));
}

Router::Router(Settings settings, std::vector<const Script*> scripts,
               std::function<void(const std::string&)> on_server_changed, std::chrono::milliseconds max_backoff,
               Router* map_from)
    : settings_(std::move(settings)), scripts_(std::move(scripts)), on_server_changed_(std::move(on_server_changed)),
      max_backoff_(max_backoff) {
  if (!settings_.cluster()) {
    single_ = std::make_unique<Connection>(settings_, scripts_, on_server_changed_, max_backoff_);
    return;
  }
  if (map_from) {
    // The map just read by the client's other router: reading it again would double what a
    // slow or stopped first node costs a connect.
    std::lock_guard lock(map_from->mutex_);
    slots_ = map_from->slots_;
    addresses_ = map_from->addresses_;
    strangers_ = map_from->strangers_;
    refreshed_at_ = map_from->refreshed_at_;
    return;
  }
  slots_.assign(kClusterSlots, -1);
  auto until = SteadyClock::now() + kConnectTimeout;
  if (settings_.connect_by) until = *settings_.connect_by;
  std::string failures;
  if (!refresh(until, {}, &failures)) {
    throw BackendUnavailable("no node of " + settings_.description + " answered CLUSTER SLOTS: " + failures);
  }
}

Router::~Router() = default;

Connection& Router::node(const std::string& address) {
  std::lock_guard lock(mutex_);
  auto& slot = nodes_[address];
  if (!slot) {
    Settings settings = settings_;
    const auto colon = address.rfind(':');
    settings.host = address.substr(0, colon);  // unbracketed, as Opened::address (IPv6 too)
    settings.port = std::stoi(address.substr(colon + 1));
    settings.description = address + " (a node of the redis cluster)";
    slot = std::make_unique<Connection>(std::move(settings), scripts_, on_server_changed_, max_backoff_, false);
  }
  return *slot;
}

namespace {

// Reads CLUSTER SLOTS' reply (from the node at `asked_host`) into a map: node index by slot, and
// the nodes' addresses. False when the reply is of a shape CLUSTER SLOTS never gives.
bool read_slot_map(const redisReply* reply, const std::string& asked_host, std::vector<int>& slots,
                   std::vector<std::string>& addresses) {
  for (std::size_t r = 0; r < reply->elements; ++r) {
    const auto* range = reply->element[r];
    if (range->type != REDIS_REPLY_ARRAY || range->elements < 3 || range->element[0]->type != REDIS_REPLY_INTEGER ||
        range->element[1]->type != REDIS_REPLY_INTEGER || range->element[2]->type != REDIS_REPLY_ARRAY ||
        range->element[2]->elements < 2 || range->element[2]->element[1]->type != REDIS_REPLY_INTEGER) {
      return false;
    }
    const auto first = range->element[0]->integer, last = range->element[1]->integer;
    const auto port = range->element[2]->element[1]->integer;
    if (port <= 0 || port > 65535) continue;  // a primary whose address is unknown (noaddr): no node serves these
    auto host = std::string(reply_view(range->element[2]->element[0]));
    if (host.empty() || host == "?") host = asked_host;  // "this node's address", as redis-cli reads it
    // host:port with the host unbracketed, as Opened::address and MOVED write it.
    const auto address = host + ":" + std::to_string(port);
    if (first < 0 || last >= kClusterSlots || first > last ||
        !valid_host(host.find(':') == std::string::npos ? host : "[" + host + "]")) {
      return false;
    }
    auto at = std::find(addresses.begin(), addresses.end(), address);
    if (at == addresses.end()) at = addresses.insert(addresses.end(), address);
    std::fill(slots.begin() + first, slots.begin() + last + 1, static_cast<int>(at - addresses.begin()));
  }
  return true;
}

}  // namespace

bool Router::adopt_map(std::vector<int> slots, std::vector<std::string> addresses) {
  std::lock_guard lock(mutex_);
  bool changed = false;
  for (int s = 0; s < kClusterSlots && !changed; ++s) {
    const auto* was = slots_[s] < 0 ? nullptr : &addresses_[slots_[s]];
    const auto* now_at = slots[s] < 0 ? nullptr : &addresses[slots[s]];
    changed = (was == nullptr) != (now_at == nullptr) || (was && *was != *now_at);
  }
  const bool first_map = addresses_.empty();
  slots_ = std::move(slots);
  addresses_ = std::move(addresses);
  refreshed_at_ = SteadyClock::now();
  return changed && !first_map;
}

std::vector<std::string> Router::map_sources() {
  std::lock_guard lock(mutex_);
  // The URL's nodes, then every node the map has named; starting where the last pass started
  // + 1, so one node that answers wrongly does not answer every time. A server that said it is
  // no cluster node is left out.
  std::vector<std::string> candidates;
  for (const auto& seed : settings_.cluster_seeds) candidates.push_back(seed.host + ":" + std::to_string(seed.port));
  for (const auto& address : addresses_) {
    if (std::find(candidates.begin(), candidates.end(), address) == candidates.end()) candidates.push_back(address);
  }
  std::erase_if(candidates, [&](const std::string& address) { return strangers_.count(address) > 0; });
  if (!candidates.empty()) {
    std::rotate(candidates.begin(), candidates.begin() + static_cast<long>(next_seed_++ % candidates.size()),
                candidates.end());
  }
  return candidates;
}

bool Router::refresh(SteadyClock::time_point until, const std::stop_token& stop, std::string* failures) {
  std::unique_lock busy(refreshing_, std::defer_lock);
  if (!busy.try_lock_until(until)) return false;
  {
    std::lock_guard lock(mutex_);
    if (SteadyClock::now() - refreshed_at_ < kMinRefreshInterval) return true;  // another caller just did
  }
  const auto candidates = map_sources();
  const auto failed = [&](const std::string& why) {
    if (failures) *failures += (failures->empty() ? "" : "; ") + why;
  };
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const auto now = SteadyClock::now();
    if (now >= until || stop.stop_requested()) return false;
    // The last node asked gets all the time left (a slow network still gets its answer).
    const SteadyClock::duration share =
        i + 1 == candidates.size()
            ? until - now
            : std::min<SteadyClock::duration>(
                  std::max<SteadyClock::duration>((until - now) / static_cast<long>(candidates.size() - i),
                                                  milliseconds(300)),
                  kMapAttempt);
    Result answer;
    try {
      // A node that refuses connections (down) or is in its reconnect backoff is passed over
      // at once: the next may answer, and a CLI run must not wait out a dead first seed.
      answer = node(candidates[i])
                   .command_result({"CLUSTER", "SLOTS"},
                                   {.budget = {std::min(until, now + share), stop}, .fail_fast = true});
    } catch (const AccessDenied&) {
      throw;
    } catch (const EvictingServer&) {
      throw;  // the whole cluster is refused: this node would serve some names
    } catch (const BackendUnavailable& error) {
      failed(error.what());
      continue;
    }
    if (!answer.ok()) {
      failed(refused_slot_map(candidates[i], answer.error));
      continue;
    }
    const auto* reply = answer.reply.get();
    std::vector<int> slots(kClusterSlots, -1);
    std::vector<std::string> addresses;
    if (!reply || reply->type != REDIS_REPLY_ARRAY || reply->elements == 0 ||
        !read_slot_map(reply, candidates[i].substr(0, candidates[i].rfind(':')), slots, addresses)) {
      failed(candidates[i] + " has no slots assigned (or answered CLUSTER SLOTS oddly)");
      continue;
    }
    const bool changed = adopt_map(std::move(slots), std::move(addresses));
    if (changed && on_server_changed_) on_server_changed_(std::string());
    return true;
  }
  return false;
}

std::string Router::refused_slot_map(const std::string& address, const std::exception_ptr& error) {
  std::string why;
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& refusal) {
    why = refusal.what();
  }
  // Redis without cluster-enabled answers "ERR This instance has cluster support disabled".
  if (why.find("cluster support disabled") == std::string::npos) return why;
  bool connecting;
  {
    std::lock_guard lock(mutex_);
    strangers_.insert(address);  // never asked again, nor listened on
    connecting = addresses_.empty();
  }
  const auto message = "redis at " + address + ", named in " + settings_.description +
                       ", is not a node of a Redis Cluster (cluster support disabled): name the cluster's nodes, "
                       "or use redis:// for a single server";
  // At connect the URL is wrong: said at once, whatever the other nodes would answer.
  if (connecting) throw BackendUnavailable(message);
  return message;
}

std::vector<SentinelAddress> Router::listening_nodes() {
  std::vector<SentinelAddress> found;
  const auto add = [&](const std::string& address) {
    const auto colon = address.rfind(':');
    found.push_back(
        {address.substr(0, colon), std::stoi(address.substr(colon + 1)), address + " (a node of the redis cluster)"});
  };
  std::lock_guard lock(mutex_);
  // The primaries that serve slots, by the latest map: members for certain, and alive then.
  for (std::size_t i = 0; i < addresses_.size(); ++i) {
    if (std::find(slots_.begin(), slots_.end(), static_cast<int>(i)) != slots_.end()) add(addresses_[i]);
  }
  for (const auto& seed : settings_.cluster_seeds) {
    const auto address = seed.host + ":" + std::to_string(seed.port);
    if (!strangers_.count(address) && std::find(addresses_.begin(), addresses_.end(), address) == addresses_.end()) {
      found.push_back(seed);
    }
  }
  return found;
}

void Router::refresh_by(const CallBudget& budget) {
  // A connect timeout's worth, by the deadline (one already passed: a try-once's own caps).
  auto until = SteadyClock::now() + kConnectTimeout;
  if (budget.deadline() && !passed(budget.deadline())) until = std::min(until, *budget.deadline());
  refresh(until, budget.stop());
}

std::string Router::owner(const std::string& key) {
  const auto slot = key_slot(key);
  std::lock_guard lock(mutex_);
  return slots_.empty() || slots_[slot] < 0 ? std::string() : addresses_[slots_[slot]];
}

bool Router::serves_slots(const std::string& address) {
  std::lock_guard lock(mutex_);
  const auto at = std::find(addresses_.begin(), addresses_.end(), address);
  return at != addresses_.end() && std::find(slots_.begin(), slots_.end(), at - addresses_.begin()) != slots_.end();
}

std::string Router::owner_of(int slot, const CallBudget& budget) {
  for (;;) {
    {
      std::lock_guard lock(mutex_);
      if (slots_[slot] >= 0) return addresses_[slots_[slot]];
    }
    // No node serves the slot by our map (its primary failed with no replica to take over, or
    // the map is being changed): read it again, by the deadline.
    refresh_by(budget);
    {
      std::lock_guard lock(mutex_);
      if (slots_[slot] >= 0) return addresses_[slots_[slot]];
    }
    if (budget.passed()) {
      throw BackendUnavailable("no node of " + settings_.description + " serves hash slot " + std::to_string(slot));
    }
    pause_within(budget, kRetryPause);
  }
}

Result Router::routed(int slot, const CallBudget& budget, bool idempotent, const Attempt& attempt) {
  std::string ask;  // the node an ASK named, for the next attempt only
  int redirects = 0;
  for (;;) {
    const bool asking = !ask.empty();
    const auto address = asking ? std::exchange(ask, std::string()) : owner_of(slot, budget);
    Result result;
    try {
      result = attempt(node(address), budget.for_call(kNodeShare), asking);
    } catch (const AccessDenied&) {
      throw;
    } catch (const EvictingServer&) {
      throw;
    } catch (const BackendUnavailable&) {
      // The node did not answer (down, paused, failing over): the map may name another by now.
      if (!idempotent || budget.passed()) throw;
      refresh_by(budget);
      pause_within(budget, kRetryPause);
      continue;
    }
    if (result.ok()) return result;
    try {
      std::rethrow_exception(result.error);
    } catch (const Redirected& redirect) {
      // CLUSTERDOWN/TRYAGAIN pass with the failover or the migration: waited out by the deadline.
      if ((redirect.kind != Redirected::Kind::again && ++redirects > kMaxRedirects) || budget.stopped()) return result;
      switch (redirect.kind) {
        case Redirected::Kind::ask: ask = redirect.address; break;
        case Redirected::Kind::moved: {
          refresh_by(budget);
          // The map may lag the node that answered: the redirection wins for this slot.
          std::lock_guard lock(mutex_);
          if (slots_[slot] < 0 || addresses_[slots_[slot]] != redirect.address) {
            auto at = std::find(addresses_.begin(), addresses_.end(), redirect.address);
            if (at == addresses_.end()) at = addresses_.insert(addresses_.end(), redirect.address);
            slots_[slot] = static_cast<int>(at - addresses_.begin());
          }
          break;
        }
        case Redirected::Kind::again:
          if (passed(budget.deadline())) return result;
          pause_within(budget, kRetryPause);
          break;
      }
    } catch (...) {
      return result;  // any other error reply is the call's answer
    }
  }
}

Reply Router::eval(const Script& script, const std::vector<std::string>& keys, const std::vector<std::string>& args,
                   const CallOptions& options) {
  if (single_) return single_->eval(script, keys, args, options);
  auto result = routed(key_slot(keys.front()), options.budget, options.idempotent,
                       [&](Connection& node, const CallBudget& share, bool asking) {
                         auto on_node = options;
                         on_node.budget = share;
                         on_node.server = nullptr;
                         on_node.asking = asking;
                         return node.eval_result(script, keys, args, on_node);
                       });
  if (options.server) *options.server = result.server;
  return result.take();
}

std::vector<Result> Router::eval_each(const std::vector<ScriptCall>& calls, const CallBudget& budget) {
  if (single_) return single_->eval_each(calls, budget);
  // One pipelined round trip per node, all at once; what a node did not answer, or redirected,
  // goes out again alone, routed.
  std::map<std::string, std::vector<std::size_t>> by_node;
  for (std::size_t i = 0; i < calls.size(); ++i) {
    by_node[owner_of(key_slot(std::get<1>(calls[i]).front()), CallBudget(budget.deadline()))].push_back(i);
  }
  std::vector<Result> results(calls.size());
  std::vector<char> again(calls.size(), 0);  // not vector<bool>: the nodes' threads set their own elements
  const auto run_node = [&](const std::string& address, const std::vector<std::size_t>& indices) {
    std::vector<ScriptCall> mine;
    for (const auto i : indices) mine.push_back(calls[i]);
    try {
      auto answers = node(address).eval_each(mine, budget);
      for (std::size_t k = 0; k < indices.size(); ++k) results[indices[k]] = std::move(answers[k]);
    } catch (...) {
      for (const auto i : indices) {
        results[i].error = std::current_exception();
        again[i] = 1;
      }
    }
  };
  std::vector<std::future<void>> running;
  for (const auto& [address, indices] : by_node) {
    if (running.size() + 1 == by_node.size()) {
      run_node(address, indices);  // the last on this thread
    } else {
      running.push_back(std::async(std::launch::async, run_node, std::cref(address), std::cref(indices)));
    }
  }
  for (auto& each : running) each.get();
  for (std::size_t i = 0; i < calls.size(); ++i) {
    if (!again[i] && results[i].ok()) continue;
    if (!again[i]) {
      try {
        std::rethrow_exception(results[i].error);
      } catch (const Redirected&) {
      } catch (...) {
        continue;  // the call's own answer
      }
    }
    const auto& [script, keys, args] = calls[i];
    try {
      results[i] =
          routed(key_slot(keys.front()), budget, true, [&](Connection& node, const CallBudget& share, bool asking) {
            return node.eval_result(*script, keys, args, {.budget = share, .idempotent = true, .asking = asking});
          });
    } catch (...) {
      results[i] = Result{};
      results[i].error = std::current_exception();
    }
  }
  return results;
}

std::vector<Reply> Router::eval_pipelined(const std::vector<ScriptCall>& calls, const CallBudget& budget) {
  if (single_) return single_->eval_pipelined(calls, budget);
  auto results = eval_each(calls, budget);
  std::vector<Reply> replies;
  for (auto& result : results) replies.push_back(result.take());
  return replies;
}

Reply Router::command(const Command& command, const CallBudget& budget, const std::string& key) {
  if (single_) return single_->command(command, budget);
  return routed(key_slot(key), budget, true,
                [&](Connection& node, const CallBudget& share, bool asking) {
                  return node.command_result(command, {.budget = share, .asking = asking});
                })
      .take();
}

bool Router::watch_idle(SteadyClock::time_point until, int wake_fd) {
  if (single_) return single_->watch_idle(until, wake_fd);
  // Every node's idle connection at once: a node killed (and perhaps restarted empty, before
  // any failover) is noticed now, and the round that follows finds its new boot, rather than
  // at the next regular round, up to TTL/3 later, after another contender may have got in.
  std::vector<Connection*> lenders;
  std::vector<pollfd> fds{{wake_fd, POLLIN, 0}};
  {
    std::lock_guard lock(mutex_);
    for (auto& [address, connection] : nodes_) {
      const int fd = connection->lend_idle();
      if (fd < 0) continue;
      lenders.push_back(connection.get());
      fds.push_back({fd, POLLIN | POLLRDHUP, 0});
    }
  }
  const int left = poll_timeout(until);
  while (poll(fds.data(), fds.size(), left) < 0 && errno == EINTR) {
  }
  bool dropped = false;
  for (std::size_t i = 0; i < lenders.size(); ++i)
    dropped = lenders[i]->take_back_idle(fds[i + 1].revents != 0) || dropped;
  return dropped;
}

bool Router::knows_node(const std::string& address) {
  std::lock_guard lock(mutex_);
  return nodes_.count(address) > 0;
}

void Router::follow(const std::string& server) {
  if (single_) single_->follow(server);
}

bool Router::primary_moved(const std::string& address) { return single_ && single_->primary_moved(address); }

std::vector<std::string> Router::primaries(const CallBudget& budget) {
  if (single_) return {""};
  const auto serving = [&] {
    std::lock_guard lock(mutex_);
    std::set<std::string> found;
    for (const int index : slots_) {
      if (index >= 0) found.insert(addresses_[index]);
    }
    return found;
  };
  auto found = serving();
  if (found.empty()) {
    refresh_by(budget);
    found = serving();
  }
  if (found.empty()) throw BackendUnavailable("no node of " + settings_.description + " serves any hash slot");
  return {found.begin(), found.end()};
}

Reply Router::command_at(const std::string& address, const Command& command, const CallBudget& budget) {
  return single_ ? single_->command(command, budget) : node(address).command(command, budget);
}

}  // namespace turnstile::detail::redis
