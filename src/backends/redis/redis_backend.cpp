// SPDX-License-Identifier: Apache-2.0
// The Redis backend: every state change is one Lua script (scripts/*.lua), so an uncontended
// acquire and a release are one round trip each. Everything one name needs lives in ONE hash
// (eviction or deletion takes all of it or nothing): a queue ordered by fencing tokens that
// keep growing even when that hash is lost (max(last + 1, server time in µs)), whose entries
// are leases renewed by a watchdog on its own connection every TTL/3 and reaped by the next
// script once they run out. Waiters sleep until a message names them, then ask the server: a
// message only wakes, the scripts alone admit. PermitCounter keeps Redisson's RSemaphore layout
// so Java and C++ share permits.
#include "backends/redis/redis_backend.hpp"

#include <algorithm>
#include <thread>

#include "backends/redis/scripts.hpp"
#include "backends/redis/wire.hpp"
#include "core/host_name.hpp"

namespace turnstile::detail::redis {
namespace {

// Retirements are tried for as long as the server remembers the request (after that nothing
// could tell a late copy of it anyway).
Backoff retirement_backoff(const Settings& settings) {
  auto backoff = kRedisTimes.background;
  backoff.give_up = request_memory(settings);
  return backoff;
}

}  // namespace

RedisBackend::RedisBackend(Settings settings, EvictionRule eviction, ErrorHandler warn, const std::string& label)
    : settings_(settings), identity_(std::to_string(getpid()) + " " + host_name()),
      label_suffix_(label.empty() ? "" : " " + label), wake_fd_(make_wake_fd()),
      request_ids_(request_memory(settings).count()),
      connection_(with_eviction_rule(settings, eviction), all_scripts(),
                  [this](const std::string& server) { on_server_changed(server); }),
      renewals_(
          settings, all_scripts(), [this](const std::string& server) { on_server_changed(server); }, renewal_retry(),
          &connection_),
      removals_(retirement_backoff(settings), {}, GuaranteedRemoval::Driver::caller),
      subscriber_(settings,
                  {.on_message = [this](const std::string& channel,
                                        const std::string& payload) { waiters_.on_message(channel, payload); },
                   .on_reset = [this] { on_subscriber_reset(); },
                   .on_confirmed = [this](const std::string& channel) { waiters_.poke_channel(channel); },
                   .on_turn = [this] { waiters_.run_due(); }},
                  settings.cluster() ? std::function([this] { return connection_.listening_nodes(); })
                                     : std::function<std::vector<SentinelAddress>()>()) {
  check_eviction_policy(connection_, settings_, eviction, warn);
  watchdog_ = std::jthread([this](std::stop_token stop) { watchdog_loop(stop); });
}

RedisBackend::~RedisBackend() {
  watchdog_.request_stop();
  renew_soon();  // wakes the watchdog
  if (watchdog_.joinable()) watchdog_.join();
  // Pipelined releases still unanswered are read now (bounded), while their holds can settle.
  connection_.collect_pending(SteadyClock::now() + kCollectPatience);
  // A client ending with requests still to retire (a give-up whose clean-up has not got
  // through: the server stalled, or the link is cut) tries them once more, each try at most
  // kExitAttempt, until they are answered or kRedisTimes.drain_at_end has passed. Whatever is still
  // unanswered then is dropped: a copy of it reaching the server later may still apply (the
  // docs/backends/redis.md, how it works: a client that ends during a partition).
  removal_budget_ = CallBudget(SteadyClock::now() + kRedisTimes.drain_at_end);
  removal_attempt_cap_ = kExitAttempt;
  removals_.drain(kRedisTimes.drain_at_end);
  // The subscriber's thread joins next; the eventfd outlives it (declared first).
}

void RedisBackend::track(RedisHold* hold) {
  std::lock_guard lock(holds_mutex_);
  holds_.insert(hold);
  // A primary change noticed between the admitting script's reply and now.
  if (settings_.sentinel() && !primary_.empty() && hold->server() != primary_) {
    hold->state()->lease->lose(primary_changed(hold->server(), primary_), LossCause::failover);
  }
  if (settings_.cluster() && demoted(connection_, *hold->state(), hold->name(), hold->server())) {
    hold->state()->lease->lose(primary_changed(hold->server(), connection_.owner(keys_of(hold->name()).keys.front())),
                               LossCause::failover);
  }
  // The watchdog notices a node going away through its own idle connection to it: on a node
  // it has none to yet, it renews now, which opens one (else a node killed and restarted
  // empty before the first round went unnoticed for up to TTL/3).
  if (settings_.cluster() && !renewals_.knows_node(hold->server().substr(0, hold->server().find(' ')))) renew_soon();
}

bool RedisBackend::demoted(Router& router, const HoldLease& state, const std::string& name, const std::string& server) {
  const auto owner = router.owner(keys_of(name).keys.front());
  return !state.releasing && !owner.empty() && owner != address_of(server) && !router.serves_slots(address_of(server));
}

void RedisBackend::on_subscriber_reset() {
  waiters_.poke_all();
  // The subscriber lost its connection and made a new one: the server may have restarted
  // without the holds' entries. One renewal round finds out.
  renew_soon();
}

std::string RedisBackend::primary_changed(const std::string& was, const std::string& now) {
  const auto address = address_of;
  return "the redis primary changed (a failover or a restart: the hold was taken on " + address(was) +
         (address(was) == address(now) ? " before it restarted" : ", the primary is now " + address(now)) +
         "); replication is asynchronous, so its entry may be gone or the name handed to another";
}

void RedisBackend::on_server_changed(const std::string& server) {
  if (settings_.cluster() && !server.empty()) {
    // A node came back as another boot of itself (a restart): what it admitted before is gone.
    std::lock_guard lock(holds_mutex_);
    for (auto* hold : holds_) {
      if (address_of(hold->server()) == address_of(server) && hold->server() != server && !hold->state()->releasing) {
        hold->state()->lease->lose(primary_changed(hold->server(), server), LossCause::failover);
      }
    }
  }
  if (settings_.sentinel()) {
    // Both connections follow: no call goes to the old primary any more.
    connection_.follow(server);
    renewals_.follow(server);
    std::lock_guard lock(holds_mutex_);
    primary_ = server;
    for (auto* hold : holds_) {
      if (hold->server() != server && !hold->state()->releasing) {
        hold->state()->lease->lose(primary_changed(hold->server(), server), LossCause::failover);
      }
    }
  }
  renew_soon();
}

FollowUp RedisBackend::replica_wait(Deadline deadline, bool (*admitted)(const redisReply*)) const {
  if (settings_.min_replicas <= 0) return {};
  const auto replicas = settings_.min_replicas;
  return [deadline, admitted, replicas](const std::vector<Reply>& replies) -> std::optional<Command> {
    if (replies.empty() || !admitted(replies.front().get())) return std::nullopt;
    // The caller's time left, at least kMinReplicaWait (a try-once or a deadline about to pass
    // still gets a chance), at most kConnectTimeout: the core's rule.
    const auto wait = CallBudget(deadline).call_timeout({.floor = kMinReplicaWait, .cap = kConnectTimeout});
    return Command{"WAIT", std::to_string(replicas), std::to_string(wait.count())};
  };
}

void RedisBackend::check_replicas(const Reply& reply) const {
  if (auto error = not_replicated(settings_, reply.get())) std::rethrow_exception(error);
}

void RedisBackend::leave(const std::string& name, const std::string& seq, std::uint64_t join, bool settle_join,
                         milliseconds patience) noexcept {
  try {
    const auto keys = keys_of(name);
    const auto& key = keys.keys.back();
    const auto release = request_ids_.open(key);
    std::vector<std::uint64_t> settles{release};
    if (settle_join) settles.push_back(join);
    std::vector<std::string> args{keys.channel, seq, request_ids_.id(join), release_memory_ms(),
                                  request_ids_.marked(key, release)};
    try {
      if (patience.count() > 0) {
        integer_of(connection_.eval(scripts::release, keys.keys, args,
                                    {.budget = Deadline(SteadyClock::now() + patience), .idempotent = true}));
        for (const auto n : settles) request_ids_.settle(key, n);
        return;
      }
    } catch (...) {
    }
    retire_later({&scripts::release, keys.keys, std::move(args), key, std::move(settles)});
  } catch (...) {
  }
}

namespace {

// Settles a retirement's request numbers when the last copy of its attempt goes: answered,
// given up, or dropped at the client's end.
struct Settler {
  RequestIds& ids;
  std::string key;
  std::vector<std::uint64_t> numbers;
  ~Settler() {
    for (const auto n : numbers) ids.settle(key, n);
  }
};

}  // namespace

void RedisBackend::retire_later(Retirement retirement) {
  auto settler = std::make_shared<Settler>(Settler{request_ids_, retirement.key, std::move(retirement.settles)});
  ScriptCall call{retirement.script, std::move(retirement.keys), std::move(retirement.args)};
  const auto what = "request " + retirement.key + " (" + retirement.script->name + ")";
  removals_.add(what, [this, call = std::move(call), settler] { return retire_once(call); });
  renew_soon();  // the watchdog's wait ends by the first attempt's time (next_due)
}

Removal RedisBackend::retire_once(const ScriptCall& call) {
  // Within what the round (or the client's end) has left: past it, the attempt waits for the next.
  const auto budget = removal_budget_.until(SteadyClock::now() + removal_attempt_cap_);
  if (budget.passed()) return Removal::again;
  auto results = renewals_.eval_each({call}, budget);  // an error reply is the Result's, not thrown
  return results.front().ok() ? Removal::done : Removal::again;
}

void RedisBackend::renew_soon() {
  renew_requested_ = true;
  wake_watchdog();
}

void RedisBackend::wake_watchdog() {
  const std::uint64_t one = 1;
  [[maybe_unused]] auto written = write(wake_fd_.fd, &one, sizeof one);
}

}  // namespace turnstile::detail::redis

extern "C" std::unique_ptr<turnstile::detail::Backend> turnstile_backend_factory_v2(
    const turnstile::detail::BackendUrl& url, const turnstile::ClientOptions& options,
    turnstile::detail::BackendReports& reports) {
  using namespace turnstile::detail::redis;
  auto own = url;
  const auto eviction = take_eviction_rule(own);
  auto settings = parse_settings(own, options);
  settings.reports = &reports;
  const auto connect_by = settings.connect_by;
  const auto description = settings.description;
  const bool many_nodes = settings.sentinel() || settings.cluster();
  try {
    return std::make_unique<RedisBackend>(std::move(settings), eviction, options.error_handler, options.holder_label);
  } catch (const turnstile::BackendUnavailable& error) {
    // A step that ran out of the connect timeout (the TCP connect, AUTH, the first commands): the
    // connect timed out, which is what the message must say ("no answer in time" blamed a live
    // server given 1 ms), in etcd's words. Only then: a refused port or an unknown host that
    // failed past the deadline keeps its own reason (red team rt29 F5).
    const bool ran_out = std::string_view(error.what()).ends_with(kNoAnswerInTime);
    if (!connect_by || !ran_out || turnstile::SteadyClock::now() < *connect_by) throw;
    // With sentinels or cluster seeds, what each one did (a refusal among them) follows.
    throw turnstile::BackendUnavailable("connecting to redis at " + description + " timed out after " +
                                        std::to_string(options.connect_timeout.count()) + " ms" +
                                        (many_nodes ? std::string(" (") + error.what() + ")" : std::string()));
  }
}
