// SPDX-License-Identifier: Apache-2.0
// What a Redis client does about a server that may evict lock state (maxmemory-policy
// allkeys-*): ?eviction=refuse (the default), warn or allow.
#pragma once

#include "backends/redis/cluster.hpp"
#include "core/url.hpp"
#include "turnstile/client.hpp"

namespace turnstile::detail::redis {

// Refusing is the default: an evicted hold lets another contender in before its holder hears
// of it.
struct EvictionRule {
  enum class Action { refuse, warn, allow } action = Action::refuse;
};

// Reads ?eviction= and takes it out of the URL (before parse_settings, which knows only ttl).
// Throws InvalidUrl for another value.
EvictionRule take_eviction_rule(BackendUrl& url);

// The settings of the backend's command connection: with refuse, each new link asks its
// server's policy in its hello (Settings::refuse_evicting), so a cluster node first used, or a
// primary a failover brings, is refused as the first server is. The renewals' connection does
// not check: holds already taken are renewed, not suddenly lost.
Settings with_eviction_rule(Settings settings, const EvictionRule& rule);

// At connect: CONFIG GET maxmemory-policy (when the user may). With allkeys-*, throws
// BackendUnavailable naming the policy (refuse), reports a warning through `warn` (or stderr),
// or accepts silently (allow).
void check_eviction_policy(Router& connection, const Settings& settings, const EvictionRule& rule,
                           const ErrorHandler& warn);

}  // namespace turnstile::detail::redis
