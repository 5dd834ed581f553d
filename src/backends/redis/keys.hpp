// SPDX-License-Identifier: Apache-2.0
// Where a name's state lives on the server: one hash per queue name, Redisson's RSemaphore
// layout per PermitCounter name, and the Pub/Sub channel that wakes their waiters.
#pragma once

#include <string>
#include <vector>

#include "core/queue.hpp"

namespace turnstile::detail::redis {

struct QueueKeys {
  std::vector<std::string> keys;  // as the scripts number them
  std::string channel;
};

// The hash tag of a name's keys and channel (see keys.cpp).
std::string queue_tag(const std::string& name);
// A queue name's hash and channel in database `db`.
QueueKeys queue_keys(const std::string& name, int db);
// Throws InvalidArgument for a PermitCounter name that could reach turnstile's own keys.
void check_counter_name(const std::string& name);
// A PermitCounter name's count and waiter line (Redisson's RSemaphore layout) and its channel.
QueueKeys counter_keys(const std::string& name, bool cluster);

}  // namespace turnstile::detail::redis
