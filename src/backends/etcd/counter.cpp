// SPDX-License-Identifier: Apache-2.0
// Inspection, and the PermitCounter's plain operations (try_set, add, get, drain).
#include "backends/etcd/etcd_backend.hpp"

#include <algorithm>
#include <set>

namespace turnstile::detail::etcd {

// A counter change whose reply was lost and which was found not applied is tried again, at most
// this many times in all, before the caller hears that etcd did not answer.
constexpr int kCounterChangeTries = 3;

// --- inspection and the PermitCounter's plain operations -----------------------------------

namespace {

// The entry that tells what a name is used as: turnstile's first own entry, else the head (or
// none). An etcdctl lock's key and an empty etcdctl elect proposal read alike, and etcd's lock
// and election are one algorithm: a foreign entry counts as none (design27.md §2.1), so that
// one at the head never makes an election's reads fail.
const EntryKey* use_telling_entry(const std::vector<EntryKey>& entries) {
  if (entries.empty()) return nullptr;
  const auto own = std::find_if(entries.begin(), entries.end(), [](const EntryKey& entry) { return !entry.foreign; });
  return own != entries.end() ? &*own : &entries.front();
}

}  // namespace

Inspection EtcdBackend::inspect(const std::string& name, Deadline deadline) {
  const auto prefix = name + "/";
  pb::TxnRequest read;
  add_range(read.mutable_success(), queue_range(prefix));
  add_range(read.mutable_success(), key_range(kCounterPrefix + name));
  add_range(read.mutable_success(), queue_range(kCounterWaiterPrefix + name + "/"));
  add_range(read.mutable_success(), queue_range(candidate_key(prefix)));
  const auto answer = connection_.txn(read, CallBudget(deadline).for_call(kEtcdTimes.call), Resend::allowed);
  Inspection result;
  result.name = name;
  auto entries = entries_of(answer.responses(0).response_range(), prefix);
  mark_candidates(entries, answer.responses(3).response_range(), prefix);
  if (const auto* telling = use_telling_entry(entries)) {
    result.mode = to_string(queue_mode(*telling));
    if (result.mode == "semaphore") result.limit = telling->limit;
  }
  // An election's keys are one candidate each, whatever their values read as.
  if (result.mode == "election") {
    for (auto& entry : entries) entry.kind = EntryKind::exclusive, entry.permits = 1;
  }
  for (std::size_t i = 0; i < entries.size(); ++i) {
    EntryInfo info;
    info.fencing_token = static_cast<std::uint64_t>(entries[i].create_revision);
    info.kind = to_string(entries[i].kind);
    info.permits = entries[i].permits;
    info.pid = entries[i].pid;
    info.host = entries[i].host;
    info.since = std::chrono::system_clock::time_point(milliseconds(entries[i].since_ms));
    info.label = entries[i].label;
    if (result.mode == "election") info.value = entries[i].value;
    if (entries[i].kept_until_ms != 0) {
      info.kept_until = std::chrono::system_clock::time_point(milliseconds(entries[i].kept_until_ms));
    }
    // Its key is NAME/<lease id in hex>, as etcdctl lock and concurrency.Mutex write it.
    if (entries[i].foreign) {
      info.foreign =
          std::string(result.mode == "election" ? "etcd client (etcdctl elect)" : "etcd client (etcdctl lock)") +
          ", lease " + entries[i].key.substr(prefix.size());
    }
    info.holding = evaluate_queue(views_of(entries, i), i, entries[0].limit).admitted();
    (info.holding ? result.holders : result.waiters).push_back(info);
  }
  result.permits = counter_value(answer.responses(1).response_range()).value;
  for (const auto* kv : children(answer.responses(2).response_range(), kCounterWaiterPrefix + name + "/")) {
    EntryInfo info;
    info.kind = "permits";
    info.fencing_token = static_cast<std::uint64_t>(kv->create_revision());
    std::istringstream text(kv->value());
    long long since_ms = 0;
    std::uint64_t number = 0;
    text >> info.permits >> info.pid >> info.host >> since_ms >> number;
    info.label = label_after(text);
    info.since = std::chrono::system_clock::time_point(milliseconds(since_ms));
    result.waiters.push_back(info);
  }
  return result;
}

// Keys a page of the listing's range reads: a few round trips for most keyspaces, a small reply.
constexpr std::int64_t kNamesPage = 1000;

// A range over the keys with the prefix, keys only, a page at a time, in key order: each entry
// key NAME/<lease hex>[_<n>] names a name in use (an etcd key space may hold anything else too).
QueueNames EtcdBackend::queue_names(const std::string& prefix, std::size_t max_names, Deadline deadline) {
  const CallBudget budget(deadline);
  pb::RangeRequest page;
  page.set_key(prefix.empty() ? std::string(1, '\0') : prefix);  // "\0" to "\0": every key
  page.set_range_end(prefix_end(prefix));
  page.set_keys_only(true);
  page.set_limit(kNamesPage);
  std::set<std::string> names;
  QueueNames result;
  for (;;) {
    const auto range = connection_.range(page, budget.for_call(kEtcdTimes.call));
    for (const auto& kv : range.kvs()) {
      const auto& key = kv.key();
      const auto slash = key.rfind('/');
      if (slash == std::string::npos || !is_entry_suffix(std::string_view(key).substr(slash + 1))) continue;
      if (!names.contains(key.substr(0, slash)) && names.size() == max_names) {
        result.complete = false;
        break;
      }
      names.insert(key.substr(0, slash));
    }
    if (!result.complete || !range.more() || range.kvs().empty()) break;
    page.set_key(range.kvs(range.kvs_size() - 1).key() + '\0');  // the next key after the page's last
  }
  result.names.assign(names.begin(), names.end());
  return result;
}

// Counter changes are not idempotent: a copy of one that reaches etcd after its sender gave up
// (a stalled connection, a paused member) must change nothing. So each Txn is guarded by a
// request marker on the client's lease (request_markers.hpp) and puts it, reading "applied";
// when its reply is lost, a Txn reads the marker (applied: the call succeeded) or retires it
// ("refused": the change never applies, and is tried again). Not settled within
// the call cap, it is settled in the background and the caller hears that the outcome is
// unknown: every change applies at most once.
bool EtcdBackend::counter_try_set(const std::string& name, std::int64_t permits) {
  const auto key = kCounterPrefix + name;
  const auto set = change_counter(
      key,
      [&](const CounterValue& current) -> std::optional<pb::TxnRequest> {
        if (current.value) return std::nullopt;
        pb::TxnRequest txn;
        add_compare(txn, key, pb::Compare::CREATE, 0);
        add_put(txn.mutable_success(), key, std::to_string(permits), 0);
        return txn;
      },
      0, [](const CounterValue&) { return 1; });
  return set == 1;
}

std::int64_t EtcdBackend::counter_add(const std::string& name, std::int64_t delta) {
  const auto key = kCounterPrefix + name;
  std::int64_t updated = 0;
  const auto change = [&](const CounterValue& current) -> std::optional<pb::TxnRequest> {
    if (__builtin_add_overflow(current.value.value_or(0), delta, &updated) || updated > max_permits ||
        updated < -max_permits) {
      throw InvalidArgument("PermitCounter '" + name + "': adding " + std::to_string(delta) + " to " +
                            std::to_string(current.value.value_or(0)) + " would leave [-" +
                            std::to_string(max_permits) + ", " + std::to_string(max_permits) + "]; nothing changed");
    }
    pb::TxnRequest txn;
    add_compare(txn, key, pb::Compare::MOD, current.mod_revision);
    add_put(txn.mutable_success(), key, std::to_string(updated), 0);
    return txn;
  };
  return change_counter(key, change, 0, [&](const CounterValue&) { return updated; });
}

std::optional<std::int64_t> EtcdBackend::counter_get(const std::string& name) {
  return counter_value(connection_.range(key_range(kCounterPrefix + name))).value;
}

std::int64_t EtcdBackend::counter_drain(const std::string& name) {
  const auto key = kCounterPrefix + name;
  const auto change = [&](const CounterValue& current) -> std::optional<pb::TxnRequest> {
    if (!current.value) return std::nullopt;
    pb::TxnRequest txn;
    add_compare(txn, key, pb::Compare::MOD, current.mod_revision);
    add_put(txn.mutable_success(), key, "0", 0);
    return txn;
  };
  return change_counter(key, change, 0, [](const CounterValue& current) { return *current.value; });
}

std::int64_t EtcdBackend::change_counter(const std::string& key, const CounterChange& change, std::int64_t unchanged,
                                         const std::function<std::int64_t(const CounterValue&)>& answer) {
  int unknown_outcomes = 0;
  for (;;) {
    const auto current = counter_value(connection_.range(key_range(key)));
    auto txn = change(current);
    if (!txn) return unchanged;
    if (counter_change_applied(std::move(*txn), CallBudget().call_end(kEtcdTimes.call), unknown_outcomes))
      return answer(current);
  }
}

bool EtcdBackend::counter_change_applied(pb::TxnRequest txn, SteadyClock::time_point deadline, int& unknown_outcomes) {
  const auto lease = client_lease(CallBudget(deadline));
  const auto request = next_request();
  auto& markers = *lease->markers;
  markers.begin(request);
  markers.guard(txn, request);  // sent once (not resent): this guards its one copy
  markers.retire(txn.mutable_success(), request, kApplied);
  const auto floor = markers.add_sweep(txn.mutable_success());
  try {
    const auto answer = connection_.txn(txn, CallBudget(deadline), Resend::never);
    markers.resolved(request);
    if (answer.succeeded()) markers.swept(floor);
    return answer.succeeded();
  } catch (const LeaseGone&) {
    markers.resolved(request);  // not applied (its marker names the lease): tried on a new one
    lose_lease(lease, "etcd no longer knows the client's lease", true);
    return false;
  } catch (const BackendUnavailable& unknown) {
    // Applied or not: the marker tells, or is retired so that a late copy changes nothing.
    pb::TxnRequest settle;
    add_value_compare(settle, markers.marker(request), kApplied);
    markers.retire(settle.mutable_failure(), request, kRefused);
    const auto settled = run_cleanup(lease, std::move(settle),
                                     {.first_try = CallBudget(SteadyClock::now() + kEtcdTimes.call.cap),
                                      .finished = [lease, request] { lease->markers->resolved(request); }});
    if (!settled) throw;  // settled in the background; the caller hears the outcome is unknown
    if (settled->succeeded()) return true;
    if (++unknown_outcomes >= kCounterChangeTries) {
      throw BackendUnavailable("etcd did not answer a PermitCounter change " + std::to_string(kCounterChangeTries) +
                               " times (none applied, nor will any): " + unknown.what());
    }
    return false;
  } catch (const Error&) {
    markers.resolved(request);  // refused (AccessDenied): not applied
    throw;
  }
}
}  // namespace turnstile::detail::etcd
