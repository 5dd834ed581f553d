// SPDX-License-Identifier: Apache-2.0
// What a redis://, redis+sentinel:// or redis+cluster:// URL asks for (parse_settings).
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "core/backend.hpp"

namespace turnstile::detail::redis {

// A sentinel of a redis+sentinel:// URL, or a node of a redis+cluster:// URL.
struct SentinelAddress {
  std::string host;  // without an IPv6 address' brackets
  int port = 26379;
  std::string description;  // host:port as written
};

struct Settings {
  std::string description;  // host:port, for messages (never the password); with sentinels,
                            // the master's name and the sentinels until a primary is found
  std::string host;         // "" with sentinels: open_context asks them
  int port = 6379;
  std::string user;
  std::string password;
  int db = 0;
  std::chrono::milliseconds ttl{30'000};
  // When set, Client::connect's bound (ClientOptions::connect_timeout from the parse): what
  // the backend does while it is being made (its connections, the eviction check) ends by then.
  std::optional<SteadyClock::time_point> connect_by;
  // Where every connection of the client reports its opening and the watchdog its renewals
  // (the client's, set by the factory; it outlives the backend). None in tools and tests.
  BackendReports* reports = nullptr;
  // redis+sentinel://: the sentinels to ask, in order, for the primary of `master_name`; and
  // the password they want (sentinel_password=), if any.
  std::vector<SentinelAddress> sentinels;
  std::string master_name;
  std::string sentinel_password;
  // redis+cluster://: the nodes the URL names, asked in turn for the slot map (and, by the
  // subscriber, for any node to listen on: PUBLISH reaches every node of a cluster).
  std::vector<SentinelAddress> cluster_seeds;
  // ?min_replicas=N: an acquire returns only once WAIT says N replicas have its entry.
  int min_replicas = 0;
  // ?eviction=refuse (eviction.hpp): every new command link asks the server its maxmemory-policy
  // in its hello, and an allkeys-* one is refused (EvictingServer) before anything is written:
  // so each cluster node is checked when first used, and each primary a failover brings.
  bool refuse_evicting = false;
  bool sentinel() const { return !sentinels.empty(); }
  bool cluster() const { return !cluster_seeds.empty(); }
};

inline constexpr int kMaxMinReplicas = 100;

// redis://[user:password@]host:port[/db][?ttl=SECONDS&min_replicas=N],
// redis+sentinel://[user:password@]s1:p1,s2:p2/MASTER[?ttl=…&min_replicas=N&sentinel_password=…]
// and redis+cluster://[user:password@]h1:p1,h2:p2[?ttl=…&min_replicas=N] (database 0 only);
// ClientOptions::ttl wins when set.
Settings parse_settings(const BackendUrl& url, const ClientOptions& options);
}  // namespace turnstile::detail::redis
