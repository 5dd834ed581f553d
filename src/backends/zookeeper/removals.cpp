// SPDX-License-Identifier: Apache-2.0
#include "backends/zookeeper/removals.hpp"

#include <vector>

#include "backends/zookeeper/errors.hpp"

namespace turnstile::detail::zookeeper {

Removal remove_orphan(const Orphan& orphan) {
  const auto session = orphan.session.lock();
  if (!session || session->expired()) return Removal::done;  // its ephemeral nodes went with it
  // No call while the connection is down: it would wait in the C client for the next one.
  if (!session->connected()) return Removal::again;
  // Bounded: on a silent link the C client completes a call only when it declares the
  // connection lost; the next attempt, after the link heals, may find it out sooner (a reply
  // out of order makes the C client reconnect at once).
  const auto bound = session->short_budget();
  // Removed, gone, or not ours to remove: done. Connection trouble: the outcome is unknown.
  const auto outcome = [](int rc) { return connection_trouble(rc) ? Removal::again : Removal::done; };
  if (!orphan.path.empty()) return outcome(session->remove(orphan.path, bound));
  // A node whose creation could not be confirmed is found by its protection id and owner.
  std::vector<std::string> mine;
  const int rc = own_children(*session, orphan.parent, orphan.uuid, bound, &mine);
  if (rc != ZOK) return outcome(rc);
  for (const auto& child : mine) {
    if (outcome(session->remove(orphan.parent + "/" + child, bound)) == Removal::again) return Removal::again;
  }
  return Removal::done;
}

std::string describe(const Orphan& orphan) {
  if (!orphan.path.empty()) return "ZooKeeper node '" + orphan.path + "'";
  return "the ZooKeeper nodes of protection id " + orphan.uuid + " under '" + orphan.parent + "'";
}

}  // namespace turnstile::detail::zookeeper
