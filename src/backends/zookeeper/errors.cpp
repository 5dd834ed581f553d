// SPDX-License-Identifier: Apache-2.0
#include "backends/zookeeper/errors.hpp"

namespace turnstile::detail::zookeeper {

bool server_answered(int rc) {
  if (rc == ZOK) return true;
  // ZSESSIONMOVED: another connection owns the session now; no word about ours.
  return rc <= ZAPIERROR && rc != ZSESSIONEXPIRED && rc != ZCLOSING && rc != ZINVALIDCALLBACK && rc != ZSESSIONMOVED;
}

bool connection_trouble(int rc) {
  // ZRUNTIMEINCONSISTENCY: a reply came out of order (replies were lost on the way); the C
  // client drops the connection and fails every pending call with this code, outcome unknown.
  return rc == ZCONNECTIONLOSS || rc == ZOPERATIONTIMEOUT || rc == ZSYSTEMERROR || rc == ZMARSHALLINGERROR ||
         rc == ZSESSIONMOVED || rc == ZTHROTTLEDOP || rc == ZRUNTIMEINCONSISTENCY || rc == ZSSLCONNECTIONERROR;
}

bool session_gone(int rc) {
  return rc == ZSESSIONEXPIRED || rc == ZINVALIDSTATE || rc == ZCLOSING || rc == ZAUTHFAILED;
}

void check_session(const Session& session, int rc) {
  if (session_gone(rc) || session.expired()) throw SessionGone{};
}

[[noreturn]] void throw_error(const std::string& what, int rc, const std::string& consequence) {
  if (rc == ZNOAUTH || rc == ZAUTHFAILED) throw AccessDenied("ZooKeeper refused " + what + ": " + zerror(rc));
  throw BackendUnavailable("ZooKeeper " + what + " failed: " + zerror(rc) + consequence);
}

[[noreturn]] void give_up(const CallBudget& bound, const std::string& what, int rc) {
  if (bound.stopped()) throw CallStopped{};
  if (connection_trouble(rc)) throw ConnectionGaveUp("ZooKeeper " + what + " failed: " + zerror(rc));
  throw_error(what, rc);
}

[[noreturn]] void unconfirmed(const std::string& what, const std::string& consequence) {
  throw BackendUnavailable("ZooKeeper did not confirm " + what + " in time: " + consequence);
}

}  // namespace turnstile::detail::zookeeper
