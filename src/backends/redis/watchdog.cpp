// SPDX-License-Identifier: Apache-2.0
#include "backends/redis/redis_backend.hpp"
#include "backends/redis/scripts.hpp"

#include <map>
#include <optional>

namespace turnstile::detail::redis {

// Renews every hold every TTL/3 on its own connection, in one pipelined round trip. What the
// server answers for each entry decides: present, ours and admitted → confirmed (the loss
// clock counts from the renewal's send time); gone, or not ours, or no longer admitted → lost,
// unless the hold's release has begun (the release answers for it then). A round unanswered
// within min(TTL/3, 1 s), or answered with an error, suspends the holds and is tried again
// 250 ms later (the connection reconnects as often). The LossClock reports a hold lost when no
// renewal was confirmed for TTL − margin, whatever this thread is doing. The next round starts
// at once when the server shows a change: the idle renewal connection gets an EOF or reset (a
// restart or shutdown: this thread sleeps in poll() on it), the subscriber reconnects, or a
// connection finds another run_id. Requests given up without an answer are retired from the
// rounds too (removals_), after the renewals. The client's waiting entries are renewed in the
// same calls (one per name: renew.lua reads only the entries it names, unless one of the name's has expired),
// and a waiter whose entry the server calls admitted or gone is woken to look; while there are
// waiters, rounds come every min(TTL/3, kMaxRecheck). Async counter waiters (no thread to time
// their re-checks) are woken by the rounds to look again.
void RedisBackend::watchdog_loop(std::stop_token stop) {
  auto wait = renewal_period();
  bool settled = true;
  while (!stop.stop_requested()) {
    auto until = SteadyClock::now() + wait;
    // A retirement due sooner brings the round forward (its first try comes at once, not a
    // renewal period later); after a round that did not reach the server, the retry pause
    // comes first.
    if (const auto due = removals_.next_due(); due && settled) until = std::min(until, *due);
    sleep_until(until, stop);
    if (stop.stop_requested()) break;
    renew_requested_ = false;
    settled = renewal_round(stop);
    // Async counter waiters whose last look is half a re-check interval old or more look again:
    // with a round every interval, at most 1.5 intervals apart (within TTL/2: their places live).
    waiters_.poke_rechecks(recheck_interval() / 2);
    const bool waiting = waiters_.any_queued() || waiters_.any_rechecked();
    wait = !settled ? renewal_retry() : waiting ? std::min(renewal_period(), recheck_interval()) : renewal_period();
  }
}

bool RedisBackend::sleep_until(SteadyClock::time_point until, const std::stop_token& stop) {
  std::optional<SteadyClock::time_point> collect_at;
  while (!stop.stop_requested() && SteadyClock::now() < until) {
    if (collect_armed_ && !collect_at) collect_at = SteadyClock::now() + kCollectOwed;
    if (collect_at && SteadyClock::now() >= *collect_at) {
      collect_armed_ = false;  // before reading: a release sent from now on arms it again
      collect_at.reset();
      connection_.collect_pending(SteadyClock::now() + kCollectPatience);
      continue;
    }
    if (renewals_.watch_idle(collect_at ? std::min(until, *collect_at) : until, wake_fd_.fd)) {
      return false;  // the server went away: look now
    }
    std::uint64_t count;
    // renew_soon(), a stop, or collect_soon() (which the loop's next pass handles).
    if (read(wake_fd_.fd, &count, sizeof count) > 0 && (renew_requested_ || stop.stop_requested())) return false;
  }
  return true;
}

RedisBackend::RoundEntries RedisBackend::round_entries() {
  RoundEntries by_name;
  for (auto& queued : waiters_.queued()) by_name[queued.name].queued.push_back(std::move(queued));
  std::lock_guard lock(holds_mutex_);
  for (auto* hold : holds_) {
    // A hold being released is still renewed (a release that failed is retried later and
    // its entry must not expire under it meanwhile), but its answers are ignored.
    if (!hold->state()->lease->lost()) {
      by_name[hold->name()].holds.push_back(
          {hold->state(), std::to_string(hold->seq()), hold->request(), hold->server()});
    }
  }
  return by_name;
}

void RedisBackend::follow_sentinels() {
  // A demoted primary may accept our calls for seconds after the failover (until the
  // sentinels reconfigure it, ~10 s): ask them, every round, holds or not. When they name
  // another, both connections drop theirs: waiters look and acquires go to the new primary,
  // and the renewals reach it, whose new server loses the holds (on_server_changed).
  try {
    const auto primary = ask_sentinels(settings_, SteadyClock::now() + std::min(renewal_period(), kRenewalPatience));
    const auto host = primary.host.starts_with('[') ? primary.host.substr(1, primary.host.size() - 2) : primary.host;
    const auto address = host + ":" + std::to_string(primary.port);
    connection_.primary_moved(address);
    renewals_.primary_moved(address);
  } catch (const std::exception&) {
    // No sentinel answered: the renewal itself says what the primary we know thinks.
  }
}

void RedisBackend::drop_demoted(RoundEntries& by_name) {
  // As with sentinels: the slot map, read again every round, holds or not. A hold whose node
  // a failover demoted is lost, and not renewed on the new primary: its entry there, if
  // replication carried it, runs out by its TTL. Any other hold is renewed, and lost when
  // another node than its own answers (settle_renewals).
  map_fresh_ = renewals_.refresh(SteadyClock::now() + std::min(renewal_period(), kRenewalPatience));
  for (auto it = by_name.begin(); it != by_name.end();) {
    std::erase_if(it->second.holds, [&](const Renewal& renewal) {
      if (!demoted(renewals_, *renewal.state, it->first, renewal.server)) return false;
      renewal.state->lease->lose(primary_changed(renewal.server, renewals_.owner(keys_of(it->first).keys.front())),
                                 LossCause::failover);
      return true;
    });
    it = it->second.holds.empty() && it->second.queued.empty() ? by_name.erase(it) : std::next(it);
  }
}

bool RedisBackend::renewal_round(const std::stop_token& stop) {
  auto by_name = round_entries();
  if (settings_.sentinel()) follow_sentinels();
  if (settings_.cluster()) drop_demoted(by_name);
  const auto sent_at = SteadyClock::now();
  const CallBudget round{sent_at + std::min(renewal_period(), kRenewalPatience), stop};
  bool settled = true;
  if (!by_name.empty()) {
    std::vector<ScriptCall> calls;
    for (auto& [name, entries] : by_name) {
      const auto keys = keys_of(name);
      std::vector<std::string> args{keys.channel, std::to_string(settings_.ttl.count())};
      for (auto& renewal : entries.holds) args.insert(args.end(), {renewal.seq, renewal.request});
      for (auto& queued : entries.queued) args.insert(args.end(), {queued.seq, queued.request});
      calls.emplace_back(&scripts::renew, keys.keys, std::move(args));
    }
    try {
      settled = apply_round(by_name, renewals_.eval_each(calls, round), sent_at);
    } catch (const std::exception& error) {
      if (settings_.reports)
        settings_.reports->renewal_failed(std::string("the renewal did not reach redis: ") + error.what());
      for (auto& [name, entries] : by_name) {
        for (auto& renewal : entries.holds) {
          if (!renewal.state->releasing)
            renewal.state->lease->unconfirmed("the renewal did not reach redis; its entry may still be alive");
        }
      }
      return false;  // the retirements wait for a round that reaches the server
    }
  }
  // The retirements that are due, within what is left of the round.
  removal_budget_ = round;
  removal_attempt_cap_ = kRenewalPatience;
  removals_.run_due();
  return settled;
}

bool RedisBackend::apply_round(RoundEntries& by_name, const std::vector<Result>& results,
                               SteadyClock::time_point sent_at) {
  bool settled = true;
  std::size_t at = 0;
  for (auto& [name, entries] : by_name) {
    const auto& result = results[at++];
    settled = settle_renewals(entries.holds, result, sent_at, result.server, entries.queued.size()) && settled;
    const auto* reply = result.ok() ? result.reply.get() : nullptr;
    if (!reply || reply->type != REDIS_REPLY_ARRAY || reply->elements != entries.holds.size() + entries.queued.size()) {
      settled = settled && entries.queued.empty();  // their leases too: the next round comes soon
    }
    poke_moved_waiters(entries, result, sent_at);
  }
  return settled;
}

void RedisBackend::poke_moved_waiters(const Entries& entries, const Result& result, SteadyClock::time_point sent_at) {
  // A waiter whose entry is admitted (a message lost) or gone looks; one still waiting sleeps on.
  const auto* reply = result.ok() ? result.reply.get() : nullptr;
  if (!reply || reply->type != REDIS_REPLY_ARRAY || reply->elements != entries.holds.size() + entries.queued.size()) {
    // A server answered, but not with their places (an error reply such as WRONGTYPE): each
    // waiter looks itself, and its look reports what the server says, as a new acquire's
    // would. A call no server answered pokes nobody: the waiters wait through an outage.
    if (result.ok() || !result.server.empty()) {
      for (const auto& queued : entries.queued) waiters_.poke_entry(queued.channel, queued.seq);
    }
    return;
  }
  for (std::size_t i = 0; i < entries.queued.size(); ++i) {
    const auto* where = reply->element[entries.holds.size() + i];
    if (where->type != REDIS_REPLY_INTEGER) continue;
    if (where->integer != 0) waiters_.renewed(entries.queued[i].channel, entries.queued[i].seq, sent_at);
    if (where->integer != 1) waiters_.poke_entry(entries.queued[i].channel, entries.queued[i].seq);
  }
}

bool RedisBackend::follows_resharding(Renewal& renewal, long long where, const std::string& server) {
  // Only the entry itself, still ours and admitted, proves it moved with its slot (MIGRATE
  // carries a key with its expiry); anything else is lost as before. Without a fresh map a
  // failover cannot be told from a resharding: lost.
  // The same address as another boot is a restart (on_server_changed), never a resharding.
  const auto was = address_of(renewal.server);
  if (!settings_.cluster() || where != 2 || !map_fresh_ || was == address_of(server) || !renewals_.serves_slots(was)) {
    return false;
  }
  std::lock_guard lock(holds_mutex_);
  for (auto* hold : holds_) {
    if (hold->state() == renewal.state) hold->moved_to(server);
  }
  renewal.server = server;
  return true;
}

bool RedisBackend::settle_renewals(std::vector<Renewal>& holds, const Result& result, SteadyClock::time_point sent_at,
                                   const std::string& server, std::size_t queued) {
  // An error reply (OOM, READONLY, BUSY...) confirms nothing, and proves no loss either.
  std::string trouble = "redis answered the renewal unexpectedly";
  if (result.error) {
    try {
      std::rethrow_exception(result.error);
    } catch (const std::exception& error) {
      trouble = std::string("redis answered the renewal with an error: ") + error.what();
    }
  }
  const auto* reply = result.ok() ? result.reply.get() : nullptr;
  const bool usable = reply && reply->type == REDIS_REPLY_ARRAY && reply->elements == holds.size() + queued;
  if (settings_.reports) {
    if (usable) settings_.reports->renewed(SteadyClock::now() - sent_at);
    else settings_.reports->renewal_failed(trouble);
  }
  bool settled = true;
  for (std::size_t i = 0; i < holds.size(); ++i) {
    // Read after the answer came: a release sent before the server ran this renewal set it
    // before sending, so a renewal that crossed a release is never taken for a loss.
    if (holds[i].state->releasing) continue;
    auto& lease = holds[i].state->lease;
    long long where = -1;
    if (usable && reply->element[i]->type == REDIS_REPLY_INTEGER) where = reply->element[i]->integer;
    if ((settings_.sentinel() || settings_.cluster()) && !server.empty() && holds[i].server != server &&
        !follows_resharding(holds[i], where, server)) {
      // Renewed on another primary than the one that admitted it: its entry there may be a
      // replica's copy, or another's. Never carried over.
      lease->lose(primary_changed(holds[i].server, server), LossCause::failover);
    } else if (where == 2) {
      lease->confirmed(sent_at);
    } else if (where == 0 || where == 1) {
      // Gone, not ours, or no longer admitted: the server's state is not the one that
      // admitted us (evicted, deleted, restarted from an older snapshot).
      lease->lose(
          "its entry expired or the redis server no longer has it as admitted (evicted, deleted, or "
          "restarted without it)",
          LossCause::entry_gone);
    } else {
      lease->unconfirmed(trouble);
      settled = false;
    }
  }
  return settled;
}

}  // namespace turnstile::detail::redis
