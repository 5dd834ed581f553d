// SPDX-License-Identifier: Apache-2.0
// Nodes of ours whose removal (or whose creation) could not be confirmed, handed to the core's
// GuaranteedRemoval: removed once the connection is back, so no entry of ours stays in a queue
// (where everyone, Curator peers included, would wait behind it) until the session ends.
#pragma once

#include <memory>
#include <string>

#include "backends/zookeeper/session.hpp"
#include "core/guaranteed_removal.hpp"

namespace turnstile::detail::zookeeper {

struct Orphan {
  std::weak_ptr<Session> session;  // the nodes die with it
  std::string path;                // a node to delete, or
  std::string parent, uuid;        // every child of `parent` carrying `uuid` that this session owns
};

// One attempt at removing `orphan`, each call bounded by the session's short wait; safe to
// repeat (a node already gone counts as removed). `done` when removed, not ours to remove, or
// gone with its session; `again` on connection trouble and while the connection is down.
Removal remove_orphan(const Orphan& orphan);

// What the orphan is, for messages.
std::string describe(const Orphan& orphan);

}  // namespace turnstile::detail::zookeeper
