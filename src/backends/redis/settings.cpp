// SPDX-License-Identifier: Apache-2.0
#include "backends/redis/settings.hpp"

#include <algorithm>
#include <charconv>

namespace turnstile::detail::redis {
namespace {

// getaddrinfo takes an IPv6 address without its URL brackets.
std::string unbracketed(const std::string& host) {
  return host.starts_with('[') ? host.substr(1, host.size() - 2) : host;
}

// The URL's hosts as addresses (a cluster's nodes, or the sentinels), and their list for messages.
std::string read_addresses(const BackendUrl& url, int default_port, std::vector<SentinelAddress>& addresses) {
  std::string names;
  for (const auto& host : url.hosts) {
    const auto endpoint = parse_host_port(host, default_port, url);
    addresses.push_back(
        {unbracketed(endpoint.host), endpoint.port, endpoint.host + ":" + std::to_string(endpoint.port)});
    names += (names.empty() ? "" : ",") + addresses.back().description;
  }
  return names;
}

void read_cluster(const BackendUrl& url, Settings& settings) {
  if (url.hosts.empty())
    throw InvalidUrl("redis+cluster:// URLs name at least one node host:port, got '" + url.text + "'");
  if (!url.path.empty() && url.path != "/") {
    throw InvalidUrl("redis+cluster:// URLs name no database (a cluster has only database 0), got '" + url.text + "'");
  }
  const auto names = read_addresses(url, 6379, settings.cluster_seeds);
  settings.host.clear();
  settings.port = 0;
  settings.description = "the redis cluster of " + names;
}

void read_sentinels(const BackendUrl& url, Settings& settings) {
  if (url.hosts.empty())
    throw InvalidUrl("redis+sentinel:// URLs name at least one sentinel host:port, got '" + url.text + "'");
  const auto names = read_addresses(url, 26379, settings.sentinels);
  settings.master_name = url.path.empty() ? std::string() : url.path.substr(1);
  if (settings.master_name.empty() || settings.master_name.find('/') != std::string::npos ||
      std::any_of(settings.master_name.begin(), settings.master_name.end(),
                  [](char c) { return static_cast<unsigned char>(c) <= 0x20 || c == 0x7f; })) {
    throw InvalidUrl("redis+sentinel:// URLs end in /MASTERNAME (one segment, no spaces or control characters), got '" +
                     url.text + "'");
  }
  settings.host.clear();
  settings.port = 0;
  settings.description = "the primary of '" + settings.master_name + "' (sentinels " + names + ")";
}

void read_server(const BackendUrl& url, Settings& settings) {
  if (url.hosts.size() != 1) {
    throw InvalidUrl("redis:// URLs name exactly one host:port, got '" + url.text + "'");
  }
  const auto endpoint = parse_host_port(url.hosts.front(), 6379, url);
  settings.host = unbracketed(endpoint.host);
  settings.port = endpoint.port;
  settings.description = endpoint.host + ":" + std::to_string(settings.port);
  if (!url.path.empty() && url.path != "/") {
    const auto db_text = url.path.substr(1);
    const auto [end, error] = std::from_chars(db_text.data(), db_text.data() + db_text.size(), settings.db);
    if (error != std::errc() || end != db_text.data() + db_text.size() || settings.db < 0) {
      throw InvalidUrl("bad database number '" + db_text + "' in '" + url.text + "'");
    }
  }
}

void read_query(const BackendUrl& url, bool sentinel, Settings& settings) {
  for (const auto& [key, value] : url.query) {
    if (key == "ttl") {
      settings.ttl = parse_seconds("ttl", value, 0.3, 86400);
    } else if (key == "min_replicas") {
      int n = -1;
      const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), n);
      if (error != std::errc() || end != value.data() + value.size() || n < 0 || n > kMaxMinReplicas) {
        throw InvalidUrl("bad min_replicas=" + value + " in '" + url.text + "' (expected a whole number from 0 to " +
                         std::to_string(kMaxMinReplicas) + ")");
      }
      settings.min_replicas = n;
    } else if (key == "sentinel_password" && sentinel) {
      if (value.empty()) throw InvalidUrl("empty sentinel_password in '" + url.text + "'");
      settings.sentinel_password = value;
    } else {
      throw InvalidUrl("unknown parameter '" + key + "' in '" + url.text + "' (expected ttl, min_replicas, eviction" +
                       (sentinel ? ", sentinel_password" : "") + ")");
    }
  }
}

}  // namespace

Settings parse_settings(const BackendUrl& url, const ClientOptions& options) {
  // url.text is already redacted (no password); messages name only it.
  Settings settings;
  if (options.connect_timeout.count() > 0) settings.connect_by = SteadyClock::now() + options.connect_timeout;
  if (url.scheme == "rediss" || url.scheme == "rediss+sentinel" || url.scheme == "rediss+cluster") {
    throw BackendNotBuilt(url.scheme +
                          ":// (TLS) is not installed in this build: it needs a hiredis with TLS, which "
                          "Debian 12's 0.14 lacks");
  }
  const bool sentinel = url.scheme == "redis+sentinel";
  if (url.scheme == "redis+cluster") {
    read_cluster(url, settings);
  } else if (sentinel) {
    read_sentinels(url, settings);
  } else {
    read_server(url, settings);
  }
  settings.user = url.user;
  settings.password = url.password;
  if (!url.user.empty() && url.password.empty()) {
    // redis://secret@host is a password alone, as redis-cli -u reads it.
    settings.password = url.user;
    settings.user.clear();
  }
  read_query(url, sentinel, settings);
  if (options.ttl.count() > 0) {
    check_ttl_option(options.ttl, 0.3);
    settings.ttl = options.ttl;
  }
  return settings;
}

}  // namespace turnstile::detail::redis
