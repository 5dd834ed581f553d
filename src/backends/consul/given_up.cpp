#include "backends/consul/given_up.hpp"

#include "backends/consul/consul_backend.hpp"

namespace turnstile::detail::consul {

bool lose_refused_session(const Refused& refused, Session& session) {
  for (const auto& op : refused.ops()) {
    if (op.why == Refusal::invalid_session && op.what.find(session.id) != std::string::npos) {
      session.lease->lose("Consul no longer knows session " + session.id);
      return true;
    }
  }
  return false;
}

void retire_join(ConsulBackend& backend, std::shared_ptr<Session> session, const std::string& id, nlohmann::json undo,
                 bool now) {
  nlohmann::json mark = nlohmann::json::array();
  mark.push_back(kv_lock(marker_key(id), "", 0, session->id));
  auto retire = [&backend, mark, undo, session, marked = false]() mutable {
    if (session->lease->lost()) return true;  // the entry went with the session
    // The marker first: from then on a late delivery of the join cannot apply.
    if (!marked) {
      Refused refused;
      marked = backend.txn(mark, kConsulTimes.one_shot.floor, "removing a given-up entry", &refused).has_value();
      if (lose_refused_session(refused, *session)) return true;  // the entry went with it
    }
    if (!marked) return false;
    // Refused: the entry never came (or is gone already): nothing else to undo.
    backend.txn(undo, kConsulTimes.one_shot.floor, "removing a given-up entry");
    return true;
  };
  if (now) {
    try {
      if (retire()) return;
    } catch (...) {
      // Not reached: the background tries again (from the undo, once the marker is there).
    }
  }
  backend.removals().add("the given-up join " + id,
                         [retire = std::move(retire)]() mutable { return retire() ? Removal::done : Removal::again; });
}

}  // namespace turnstile::detail::consul
