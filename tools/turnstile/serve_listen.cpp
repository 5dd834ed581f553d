// SPDX-License-Identifier: Apache-2.0
// `turnstile serve --listen`: HOST:PORT parsed, and whether HOST is this host's loopback, the
// only place the page may be served without --allow-remote.
#include <arpa/inet.h>
#include <netinet/in.h>

#include <charconv>

#include "common.hpp"
#include "serve.hpp"

namespace turnstile::cli {
namespace {

// Whether `host` (an IP address) is a loopback address: 127.0.0.0/8, ::1, or an IPv4 loopback
// address mapped into IPv6. nullopt: not an IP address at all.
std::optional<bool> is_loopback_address(const std::string& host) {
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
  }
  return std::nullopt;
}

int parse_port(std::string_view text, std::string_view whole) {
  int port = -1;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), port);
  if (text.empty() || error != std::errc() || end != text.data() + text.size() || port < 0 || port > 65535) {
    throw InvalidArgument("--listen: the port must be a number from 0 (any free port) to 65535, in '" +
                          printable(whole) + "'");
  }
  return port;
}

}  // namespace

ListenAddress parse_listen_address(std::string_view text) {
  std::string host;
  std::string_view port_text;
  if (text.starts_with('[')) {
    const auto close = text.find(']');
    if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      throw InvalidArgument("--listen: expected [IPV6-ADDRESS]:PORT, got '" + printable(text) + "'");
    }
    host = std::string(text.substr(1, close - 1));
    port_text = text.substr(close + 2);
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string_view::npos) {
      throw InvalidArgument("--listen: expected HOST:PORT (e.g. 127.0.0.1:9464), got '" + printable(text) + "'");
    }
    host = std::string(text.substr(0, colon));
    if (host.find(':') != std::string::npos) {
      throw InvalidArgument("--listen: write an IPv6 address in brackets, as [::1]:9464, got '" + printable(text) +
                            "'");
    }
    port_text = text.substr(colon + 1);
  }
  ListenAddress address{host, parse_port(port_text, text), false};
  if (host == "localhost") {
    address.host = "127.0.0.1";
    address.loopback = true;
    return address;
  }
  const auto loopback = is_loopback_address(host);
  if (!loopback) {
    throw InvalidArgument("--listen: HOST must be an IP address or localhost, got '" + printable(host) + "'");
  }
  address.loopback = *loopback;
  return address;
}

std::string address_text(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

}  // namespace turnstile::cli
