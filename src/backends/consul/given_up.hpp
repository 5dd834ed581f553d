// Writes a client gave up on (given_up.cpp): a join whose answer never came may still arrive
// and apply later. Its id is retired first, by a marker key on the session (so it goes with the
// session), which every join checks is absent; then whatever it may have written is undone.
#pragma once

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
// do once the session is lost: its keys went with it. `now`: tried once in the caller's thread
// first (the one-shot floor a call), so that the marker is there before the caller returns.
void retire_join(ConsulBackend& backend, std::shared_ptr<Session> session, const std::string& id, nlohmann::json undo,
                 bool now = false);

}  // namespace turnstile::detail::consul
