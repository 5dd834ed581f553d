// SPDX-License-Identifier: Apache-2.0
#include "backends/consul/given_up.hpp"

#include <optional>
#include <vector>

#include "backends/consul/consul_backend.hpp"
#include "backends/consul/occupancy.hpp"

namespace turnstile::detail::consul {

bool lose_refused_session(const Refused& refused, Session& session) {
  for (const auto& op : refused.ops()) {
    if (op.why == Refusal::invalid_session && op.what.find(session.id) != std::string::npos) {
      session.lease->lose("Consul no longer knows session " + session.id, LossCause::session_expired);
      return true;
    }
  }
  return false;
}

namespace {

// Tries `step` in the caller's thread first when `patience` is above 0 (each call bounded by
// it), then hands what is left to the background removal service (each call bounded by the
// service's budget). `step(timeout)` is true when done.
template <class Step>
void now_then_in_background(ConsulBackend& backend, std::string what, std::chrono::milliseconds patience, Step step) {
  try {
    if (patience.count() > 0 && step(patience)) return;
  } catch (...) {
    // The background tries again.
  }
  backend.removals().add(std::move(what), [step = std::move(step)](const CallBudget& budget) mutable {
    const auto timeout = removal_timeout(budget);
    return timeout && step(*timeout) ? Removal::done : Removal::again;
  });
}

}  // namespace

void retire_join(ConsulBackend& backend, std::shared_ptr<Session> session, const std::string& id, nlohmann::json undo,
                 std::chrono::milliseconds patience, std::string occupied) {
  nlohmann::json mark = nlohmann::json::array();
  mark.push_back(kv_lock(marker_key(id), "", 0, session->id));
  // Each call of a try ends within `timeout`.
  auto retire = [&backend, mark, undo, session, id, occupied,
                 marked = false](std::chrono::milliseconds timeout) mutable {
    // What the join may have left besides its entry (an occupancy key is on no session).
    const auto end_occupancy = [&] {
      if (!occupied.empty()) end_occupancy_if_last(backend, occupied, timeout);
      return true;
    };
    if (session->lease->lost()) return end_occupancy();  // the entry went with the session
    // The marker first: from then on a late delivery of the join cannot apply.
    if (!marked) {
      Refused refused;
      {
        const MarkerHandOver hand_over(backend, marker_key(id));  // unanswered too: it may be there
        marked = backend.txn(mark, timeout, "removing a given-up entry", &refused).has_value();
      }
      if (lose_refused_session(refused, *session)) return end_occupancy();  // the entry went with it
    }
    if (!marked) return false;
    // Refused: the entry never came (or is gone already): nothing else to undo.
    backend.txn(undo, timeout, "removing a given-up entry");
    return end_occupancy();
  };
  // Not done here: the background tries again (from the undo, once the marker is there).
  now_then_in_background(backend, "the given-up join " + id, patience, std::move(retire));
}

void leave_queue(ConsulBackend& backend, std::shared_ptr<Session> session, const std::string& name,
                 const std::string& entry_key, std::chrono::milliseconds patience) noexcept {
  // The last one out of the queue (a waiter that gave up, a hold refused) ends its occupancy
  // (a PermitCounter's line has none: no name).
  const auto remove = [&backend, session, name, entry_key](std::chrono::milliseconds timeout) {
    const auto ops = nlohmann::json::array({retire_op(entry_key, session->id), kv_op("delete", entry_key)});
    Refused refused;
    std::optional<std::vector<KvEntry>> left;
    {
      const MarkerHandOver hand_over(backend, retired_marker_of(entry_key));  // unanswered too
      left = backend.txn(ops, timeout, "leaving a queue", &refused);
    }
    if (!left && !lose_refused_session(refused, *session)) {
      // Not the session gone (its keys went with it): the entry goes without its marker.
      if (!backend.write("DELETE", "/v1/kv/" + url_escape(entry_key), "", timeout, "leaving a queue")) return false;
    }
    if (!name.empty()) end_occupancy_if_last(backend, name, timeout);
    return true;
  };
  now_then_in_background(backend, "the entry " + entry_key + " of a queue left", patience, remove);
}

}  // namespace turnstile::detail::consul
