// SPDX-License-Identifier: Apache-2.0
// A PermitCounter's changes (try_set, add, drain, and the line's takes): each a CAS on the
// counter key in one transaction with its own request marker (counter_markers.hpp), applied at
// most once however many copies of it reach the server, whenever they do, and however many
// other changes came between.
#include <algorithm>
#include <thread>

#include "backends/consul/consul_backend.hpp"
#include "backends/consul/given_up.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail::consul {
namespace {

// How often an unknown outcome is looked at again when neither the marker nor its void lands.
constexpr int kSettleRounds = 16;
// A PermitCounter's own calls (try_set, add, get, drain) take no deadline: each gets the cap.
constexpr milliseconds kCounterCall = kConsulTimes.call.cap;
// The transaction's operations: [check-not-exists M, cas, lock M, extra...].
constexpr std::size_t kMarkerCheckOp = 0;

// The marker written "void" unless it exists: from then on no copy of its change can apply.
nlohmann::json void_ops(const ChangeMarker& marker) {
  return nlohmann::json::array(
      {kv_op("check-not-exists", marker.key), kv_lock(marker.key, kVoidMarker, 0, marker.session->id)});
}

// A CAS that lost to someone else's change is tried again after a pause that doubles, at most
// kCasRaces times: a busy peer is never answered with a hot loop, nor waited for without end.
class RaceRetry {
 public:
  RaceRetry(ConsulBackend& backend, std::string context) : backend_(backend), context_(std::move(context)) {}
  void lost() {
    if (++races_ == kCasRaces) {
      throw BackendUnavailable(context_ + ": the value changed under every one of " + std::to_string(races_) +
                               " tries");
    }
    backend_.pause_before_retry(CallBudget(), backoff_);
  }

 private:
  ConsulBackend& backend_;
  std::string context_;
  int races_ = 0;
  milliseconds backoff_ = kResendBackoff;
};

}  // namespace

ConsulBackend::CounterSeen ConsulBackend::read_counter(const std::string& key, milliseconds timeout) {
  const auto entries = read(key, false, timeout);
  if (entries.empty()) return {};
  return {counter_value_of(entries.front().value), entries.front().modify_index};
}

ChangeMarker ConsulBackend::new_marker(milliseconds timeout) {
  auto session = sessions_.main(timeout);
  return {marker_key(next_id(session->id)), session};
}

bool ConsulBackend::change_counter(const std::string& key, const CounterSeen& seen, std::int64_t n,
                                   const nlohmann::json& extra, const ChangeMarker& marker, milliseconds timeout,
                                   const std::string& context, const std::stop_token& stop) {
  CounterValue value;
  value.n = n;
  auto cas = kv_op("cas", key);
  cas["KV"]["Index"] = seen.index;  // 0: only if it does not exist yet
  cas["KV"]["Value"] = base64_encode(to_json(value));
  nlohmann::json ops = nlohmann::json::array(
      {kv_op("check-not-exists", marker.key), cas, kv_lock(marker.key, std::to_string(n), 0, marker.session->id)});
  for (const auto& more : extra) ops.push_back(more);
  const auto until = SteadyClock::now() + timeout;
  const SettledMarker settled{marker, key, seen.index, false};
  Refused refused;
  try {
    if (txn(ops, timeout, context, &refused, stop)) {
      markers_.add(*this, settled);
      return true;
    }
  } catch (const BackendUnavailable&) {
    // The reply was lost, or the stop cut the call: applied or not, the marker tells. After a
    // stop the caller is waiting: the settling gets the least a call that must reach Consul gets.
    const auto settle_by = SteadyClock::now() + kConsulTimes.one_shot.floor;
    return counter_change_applied(key, seen, marker, stop.stop_requested() ? settle_by : std::max(until, settle_by));
  }
  // A resend of ours (libcurl resends a request whose kept-alive connection died before any
  // answer) finding the marker the first copy wrote: applied.
  if (refused.at(kMarkerCheckOp, Refusal::exists)) {
    markers_.add(*this, settled);
    return true;
  }
  // The session is gone: its lock fails in every copy, none applies (the next try makes another).
  if (lose_refused_session(refused, *marker.session)) return false;
  // Someone else's change came first: this CAS, in every copy, can never apply now.
  if (refused.all(Refusal::stale)) return false;
  throw BackendUnavailable(context + ": Consul refused it: " + refused.describe());
}

std::optional<bool> ConsulBackend::marker_says_applied(const ChangeMarker& marker) {
  const auto entries = read(marker.key, false, kConsulTimes.one_shot.floor);
  if (entries.empty()) return std::nullopt;
  return entries.front().value != kVoidMarker;
}

bool ConsulBackend::counter_change_applied(const std::string& key, const CounterSeen& seen, const ChangeMarker& marker,
                                           SteadyClock::time_point until) {
  try {
    return settle_change(key, seen, marker, until);
  } catch (const BackendUnavailable&) {
    // The caller is told "outcome unknown"; a copy still on its way must not apply once Consul
    // answers again, so the void goes on in the background (Curator's guaranteed delete).
    void_in_background(key, seen, marker);
    throw;
  }
}

void ConsulBackend::void_in_background(const std::string& key, const CounterSeen& seen, const ChangeMarker& marker) {
  removals_.add("the marker of a change of " + key, [this, key, index = seen.index, marker](const CallBudget& budget) {
    if (marker.session->lease->lost()) return Removal::done;  // the marker's lock fails in every copy now
    const auto timeout = removal_timeout(budget);
    if (!timeout) return Removal::again;
    Refused refused;
    if (txn(void_ops(marker), *timeout, "voiding a change of " + key, &refused)) {
      markers_.add(*this, {marker, key, index, true});
      return Removal::done;
    }
    // There already (applied, or voided): settled either way. Or its session is gone: no copy applies.
    const bool settled = refused.at(kMarkerCheckOp, Refusal::exists) || lose_refused_session(refused, *marker.session);
    return settled ? Removal::done : Removal::again;
  });
}

std::optional<bool> ConsulBackend::settle_once(const std::string& key, const CounterSeen& seen,
                                               const ChangeMarker& marker) {
  Refused refused;
  if (txn(void_ops(marker), kConsulTimes.one_shot.floor, "settling a change of " + key, &refused)) {
    markers_.add(*this, {marker, key, seen.index, true});
    return false;
  }
  if (refused.at(kMarkerCheckOp, Refusal::exists)) {
    const auto applied = marker_says_applied(marker);
    if (applied) markers_.add(*this, {marker, key, seen.index, !*applied});
    return applied;  // nullopt: removed meanwhile (its session ended): look again
  }
  if (lose_refused_session(refused, *marker.session)) {
    // The marker went with the session, and with it what it told. No copy can apply any
    // more (its lock would fail): if the counter is still as the change saw it, none did.
    if (read_counter(key, kConsulTimes.one_shot.floor).index == seen.index) return false;
    throw BackendUnavailable("whether a change of " + key + " applied cannot be told: the session " +
                             marker.session->id + " its marker was on is gone");
  }
  throw BackendUnavailable("settling a change of " + key + ": Consul refused it: " + refused.describe());
}

bool ConsulBackend::settle_change(const std::string& key, const CounterSeen& seen, const ChangeMarker& marker,
                                  SteadyClock::time_point until) {
  auto backoff = kResendBackoff;
  for (int round = 0; round < kSettleRounds; ++round) {
    try {
      if (const auto told = settle_once(key, seen, marker)) return *told;
    } catch (const BackendUnavailable&) {
      if (SteadyClock::now() + backoff >= until) throw;
    }
    // No answer, or nothing to tell yet: the next look comes after a pause, never at once.
    if (SteadyClock::now() + backoff >= until) break;
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, kResendBackoffMax);
  }
  throw BackendUnavailable("whether a change of " + key + " applied could not be told in time (" +
                           std::to_string(kSettleRounds) + " looks at most)");
}

bool ConsulBackend::counter_try_set(const std::string& name, std::int64_t permits) {
  return change_counter(counter_key(name), {}, permits, nlohmann::json::array(), new_marker(kCounterCall), kCounterCall,
                        "setting PermitCounter '" + name + "'");
}

std::int64_t ConsulBackend::counter_add(const std::string& name, std::int64_t delta) {
  const auto key = counter_key(name);
  // Each try has its own marker and is settled (applied, or never to apply) before the next.
  for (RaceRetry retry(*this, "changing PermitCounter '" + name + "'");; retry.lost()) {
    const auto seen = read_counter(key, kCounterCall);
    const auto current = seen.value ? seen.value->n : 0;
    std::int64_t updated = 0;
    if (__builtin_add_overflow(current, delta, &updated) || updated > max_permits || updated < -max_permits) {
      throw InvalidArgument("PermitCounter '" + name + "': adding " + std::to_string(delta) + " to " +
                            std::to_string(current) + " would leave [-" + std::to_string(max_permits) + ", " +
                            std::to_string(max_permits) + "]; nothing changed");
    }
    if (change_counter(key, seen, updated, nlohmann::json::array(), new_marker(kCounterCall), kCounterCall,
                       "changing PermitCounter '" + name + "'")) {
      return updated;
    }
  }
}

std::optional<std::int64_t> ConsulBackend::counter_get(const std::string& name) {
  const auto seen = read_counter(counter_key(name), kCounterCall);
  if (!seen.value) return std::nullopt;
  return seen.value->n;
}

std::int64_t ConsulBackend::counter_drain(const std::string& name) {
  const auto key = counter_key(name);
  for (RaceRetry retry(*this, "draining PermitCounter '" + name + "'");; retry.lost()) {
    const auto seen = read_counter(key, kCounterCall);
    // Every earlier try was settled as never to apply: nothing left is nothing drained.
    if (!seen.value || seen.value->n == 0) return 0;
    if (change_counter(key, seen, 0, nlohmann::json::array(), new_marker(kCounterCall), kCounterCall,
                       "draining PermitCounter '" + name + "'")) {
      return seen.value->n;
    }
  }
}

}  // namespace turnstile::detail::consul
