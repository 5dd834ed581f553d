// SPDX-License-Identifier: Apache-2.0
// ?eviction=refuse|warn|allow: see eviction.hpp.
#include "backends/redis/eviction.hpp"

#include <algorithm>
#include <cstdio>

namespace turnstile::detail::redis {

EvictionRule take_eviction_rule(BackendUrl& url) {
  EvictionRule rule;
  if (const auto it = url.query.find("eviction"); it != url.query.end()) {
    if (it->second == "warn") {
      rule.action = EvictionRule::Action::warn;
    } else if (it->second == "allow") {
      rule.action = EvictionRule::Action::allow;
    } else if (it->second != "refuse") {
      throw InvalidUrl("bad eviction=" + it->second + " in '" + url.text + "' (expected refuse, warn or allow)");
    }
    url.query.erase(it);
  }
  return rule;
}

Settings with_eviction_rule(Settings settings, const EvictionRule& rule) {
  settings.refuse_evicting = rule.action == EvictionRule::Action::refuse;
  return settings;
}

namespace {
constexpr std::chrono::milliseconds kClusterPolicyLook{500};
}  // namespace

void check_eviction_policy(Router& connection, const Settings& settings, const EvictionRule& rule,
                           const ErrorHandler& warn) {
  Reply reply;
  try {
    auto until = SteadyClock::now() + kConnectTimeout;  // a connect's worth
    if (settings.connect_by) until = std::min(until, *settings.connect_by);
    // On a cluster every node's own hello checks its policy when first used; this look (at
    // slot 0's node) only warns early, and a node that does not answer must not hold up the
    // connect for the time a whole call gets.
    if (settings.cluster()) until = std::min(until, SteadyClock::now() + kClusterPolicyLook);
    reply = connection.command({"CONFIG", "GET", "maxmemory-policy"}, Deadline(until));
  } catch (const EvictingServer&) {
    throw;  // the link's own hello found the policy (?eviction=refuse)
  } catch (const AccessDenied&) {
    return;  // CONFIG not allowed to this user (or renamed away): nothing to check
  } catch (const BackendUnavailable&) {
    return;
  }
  if (!reply || reply->type != REDIS_REPLY_ARRAY || reply->elements < 2) return;
  const auto policy = string_at(reply.get(), 1);
  if (policy.rfind("allkeys-", 0) != 0) return;
  const auto what = eviction_risk(settings, policy);
  if (rule.action == EvictionRule::Action::refuse) {
    throw BackendUnavailable(what + ", or accept the risk with ?eviction=allow (or ?eviction=warn)");
  }
  if (rule.action == EvictionRule::Action::allow) return;
  const BackendUnavailable warning("warning: " + what + " (eviction=warn)");
  if (warn) {
    try {
      warn(warning);
    } catch (...) {
    }
  } else {
    std::fprintf(stderr, "turnstile: %s\n", warning.what());
  }
}

}  // namespace turnstile::detail::redis
