// SPDX-License-Identifier: Apache-2.0
// Writes a client gave up on (given_up.cpp): a join whose answer never came may still arrive
// and apply later. Its id is retired first, by a marker key on the session (so it goes with the
// session), which every join checks is absent; then whatever it may have written is undone.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "backends/consul/refusals.hpp"
#include "backends/consul/sessions.hpp"

namespace turnstile::detail::consul {

class ConsulBackend;

// A transaction refused because `session` no longer exists on the server (a lock's 'invalid
// session "ID"'): the session is lost now, before its renewal finds out. True when so.
bool lose_refused_session(const Refused& refused, Session& session);

// In the background (GuaranteedRemoval): the marker of join `id` on `session`, then `undo` (a transaction
// that removes what the join may have written, refused when it never came). Nothing is left to
// do once the session is lost: its keys went with it. `patience` above 0: tried once in the
// caller's thread first (each call bounded by it), so that the marker is there before the caller
// returns and no copy of the join delivered after the return can add an entry, even briefly.
// `occupied`: the name whose occupancy key the join may have written, ended after the undo when
// nobody else is in line (occupancy.hpp). The marker is kept kRetiredKeep (retired_joins.hpp).
void retire_join(ConsulBackend& backend, std::shared_ptr<Session> session, const std::string& id, nlohmann::json undo,
                 std::chrono::milliseconds patience, std::string occupied = {});

// A waiter's leave of NAME's queue: its entry removed and its marker written in one transaction
// (a late copy of its join then adds nothing), then the occupancy ended if it was the last one
// out (`name` empty: a PermitCounter's line, which has no occupancy key). Tried for `patience` in
// the caller's thread, then in the background. Never throws.
void leave_queue(ConsulBackend& backend, std::shared_ptr<Session> session, const std::string& name,
                 const std::string& entry_key, std::chrono::milliseconds patience) noexcept;

}  // namespace turnstile::detail::consul
