// A PermitCounter's changes (try_set, add, drain, and the line's takes): each a CAS on the
// counter key carrying its request id as a receipt in the value (layout.hpp), applied at most
// once however many copies of it reach the server and whenever they do.
#include <algorithm>
#include <thread>

#include "backends/consul/consul_backend.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail::consul {
namespace {

// How often an unknown outcome is looked at again when the counter keeps changing under it.
constexpr int kSettleRounds = 16;

// The receipt of request `id` in `value`: the id itself, or the id with "=AMOUNT" (a drain's).
const std::string* find_receipt(const std::optional<CounterValue>& value, const std::string& id) {
  if (!value) return nullptr;
  for (const auto& receipt : value->receipts) {
    if (receipt == id || (receipt.size() > id.size() && receipt.compare(0, id.size(), id) == 0 && receipt[id.size()] == '=')) {
      return &receipt;
    }
  }
  return nullptr;
}

}  // namespace

ConsulBackend::CounterSeen ConsulBackend::read_counter(const std::string& key, milliseconds timeout) {
  const auto entries = read(key, false, timeout);
  if (entries.empty()) return {};
  return {counter_value_of(entries.front().value), entries.front().modify_index};
}

bool ConsulBackend::change_counter(const std::string& key, const CounterSeen& seen, std::int64_t n,
                                   const nlohmann::json& extra, const std::string& id, milliseconds timeout,
                                   const std::string& context, const std::stop_token& stop) {
  auto op = kv_op("cas", key);
  op["KV"]["Index"] = seen.index;  // 0: only if it does not exist yet
  op["KV"]["Value"] = base64_encode(to_json(changed(seen.value.value_or(CounterValue{}), n, id)));
  nlohmann::json ops = nlohmann::json::array({op});
  for (const auto& more : extra) ops.push_back(more);
  const auto until = SteadyClock::now() + timeout;
  Refused refused;
  try {
    if (txn(ops, timeout, context, &refused, stop)) return true;
  } catch (const BackendUnavailable&) {
    // The reply was lost, or the stop cut the call: applied or not, the value's receipts tell.
  }
  // Refused: someone else's change, or a resend of ours (libcurl resends a request whose
  // kept-alive connection died before any answer) finding the one already applied. After a
  // stop the caller is waiting: the settling gets the least a call that must reach Consul gets.
  const auto settle_by = SteadyClock::now() + kCallFloor;
  return counter_change_applied(key, seen, id, stop.stop_requested() ? settle_by : std::max(until, settle_by), ops);
}

bool ConsulBackend::counter_change_applied(const std::string& key, const CounterSeen& seen, const std::string& id,
                                           SteadyClock::time_point until, const nlohmann::json& resend) {
  auto backoff = kResendBackoff;
  for (int round = 0; round < kSettleRounds; ++round) {
    try {
      const auto now = read_counter(key, kCallFloor);
      if (find_receipt(now.value, id)) return true;
      // Changed by others (ours would carry its receipt): a CAS on `seen` can never apply now.
      if (now.index != seen.index) return false;
      if (seen.index == 0) {
        // Still absent: nothing but the key itself makes a late create stale. Ours is sent again
        // (the same id): the first copy to arrive applies, every other finds the key there.
        if (resend.empty()) return false;  // a take never creates the key
        if (txn(resend, kCallFloor, "settling a change of " + key)) return true;
        continue;  // created meanwhile, by a copy of ours or another's: read again
      }
      // Unchanged. Rewritten with a mark of this id, not as it is: Consul skips a write that
      // changes nothing (kvsSetTxn keeps the ModifyIndex), and only a moved index makes a copy of
      // ours still on its way find `seen` stale.
      const auto voided = changed(*seen.value, seen.value->n, "void:" + id);
      if (write("PUT", "/v1/kv/" + url_escape(key) + "?cas=" + std::to_string(seen.index), to_json(voided), kCallFloor,
                "checking a change of " + key)) {
        return false;
      }
      // Refused: it changed meanwhile (perhaps by ours): read again.
    } catch (const BackendUnavailable&) {
      if (SteadyClock::now() + backoff >= until) throw;
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, kResendBackoffMax);
    }
  }
  throw BackendUnavailable("whether a change of " + key + " applied could not be told: it changed under each of " +
                           std::to_string(kSettleRounds) + " looks");
}

bool ConsulBackend::counter_try_set(const std::string& name, std::int64_t permits) {
  return change_counter(counter_key(name), {}, permits, nlohmann::json::array(), request_id(), kCallCap,
                        "setting PermitCounter '" + name + "'");
}

std::int64_t ConsulBackend::counter_add(const std::string& name, std::int64_t delta) {
  const auto key = counter_key(name);
  const auto id = request_id();  // one id for every try: a resolved try is never made again
  for (;;) {
    const auto seen = read_counter(key, kCallCap);
    // Applied already (by an earlier try): never twice.
    if (find_receipt(seen.value, id)) return seen.value->n;
    const auto current = seen.value ? seen.value->n : 0;
    std::int64_t updated = 0;
    if (__builtin_add_overflow(current, delta, &updated) || updated > max_permits || updated < -max_permits) {
      throw InvalidArgument("PermitCounter '" + name + "': adding " + std::to_string(delta) + " to " +
                            std::to_string(current) + " would leave [-" + std::to_string(max_permits) + ", " +
                            std::to_string(max_permits) + "]; nothing changed");
    }
    if (change_counter(key, seen, updated, nlohmann::json::array(), id, kCallCap,
                       "changing PermitCounter '" + name + "'")) {
      return updated;
    }
  }
}

std::optional<std::int64_t> ConsulBackend::counter_get(const std::string& name) {
  const auto seen = read_counter(counter_key(name), kCallCap);
  if (!seen.value) return std::nullopt;
  return seen.value->n;
}

std::int64_t ConsulBackend::counter_drain(const std::string& name) {
  const auto key = counter_key(name);
  const auto id = request_id();
  for (;;) {
    const auto seen = read_counter(key, kCallCap);
    // Applied already (by an earlier try): its receipt says how much it drained.
    if (const auto* receipt = find_receipt(seen.value, id)) return std::stoll(receipt->substr(id.size() + 1));
    if (!seen.value || seen.value->n == 0) return 0;
    // The receipt carries the amount, so an earlier try found applied still reports it.
    if (change_counter(key, seen, 0, nlohmann::json::array(), id + "=" + std::to_string(seen.value->n), kCallCap,
                       "draining PermitCounter '" + name + "'")) {
      return seen.value->n;
    }
  }
}

}  // namespace turnstile::detail::consul
