// SPDX-License-Identifier: Apache-2.0
#include "backends/zookeeper/settings.hpp"

#include "core/url.hpp"

namespace turnstile::detail::zookeeper {

Settings parse_settings(const BackendUrl& url, const ClientOptions& options) {
  Settings settings;
  settings.holder_label = options.holder_label;
  settings.connect_timeout = options.connect_timeout;
  if (url.hosts.empty()) throw InvalidUrl("no host in '" + url.text + "'");
  for (const auto& host : url.hosts) {
    const auto endpoint = parse_host_port(host, 2181, url);
    if (!settings.hosts.empty()) settings.hosts += ',';
    settings.hosts += endpoint.host + ":" + std::to_string(endpoint.port);
  }
  settings.description = settings.hosts;
  settings.root = url.path;
  while (!settings.root.empty() && settings.root.back() == '/') settings.root.pop_back();
  if (settings.root.find("//") != std::string::npos)
    throw InvalidUrl("empty segment in the chroot of '" + url.text + "'");
  settings.user = url.user;
  settings.password = url.password;
  if (!settings.user.empty() && settings.user.find(':') != std::string::npos) {
    throw InvalidUrl("a digest user name cannot contain ':' in '" + url.text + "'");
  }
  for (const auto& [key, value] : url.query) {
    if (key != "session_timeout" && key != "ttl") {
      throw InvalidUrl("unknown parameter '" + key + "' in '" + url.text + "' (expected session_timeout)");
    }
    settings.session_timeout = parse_seconds("session_timeout", value, 0.1, 86400);
  }
  check_ttl_option(options.ttl, 0.1);
  if (options.ttl.count() > 0) settings.session_timeout = options.ttl;
  return settings;
}

}  // namespace turnstile::detail::zookeeper
