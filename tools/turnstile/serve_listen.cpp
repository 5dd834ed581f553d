// SPDX-License-Identifier: Apache-2.0
// `turnstile serve --listen`: HOST:PORT parsed, and whether HOST (or a request's Host header) is this
// host's loopback, the only place the page may be served without --allow-remote.
#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cctype>
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

// PORT: digits only, 0 to 65535; nullopt otherwise. from_chars alone takes a sign ("-0").
std::optional<int> port_number(std::string_view text) {
  if (text.empty() || text.find_first_not_of("0123456789") != std::string_view::npos) return std::nullopt;
  int port = -1;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), port);
  if (error != std::errc() || end != text.data() + text.size() || port > 65535) return std::nullopt;
  return port;
}

// "localhost" or a name under it ("app.localhost", which browsers resolve to loopback
// themselves, RFC 6761), in any case, with or without the root's trailing dot.
bool is_localhost_name(std::string_view host) {
  if (host.ends_with('.')) host.remove_suffix(1);
  constexpr std::string_view kLocalhost = "localhost";
  if (host.size() < kLocalhost.size()) return false;
  const auto last = host.substr(host.size() - kLocalhost.size());
  const bool named = std::equal(last.begin(), last.end(), kLocalhost.begin(),
                                [](char a, char b) { return std::tolower(static_cast<unsigned char>(a)) == b; });
  if (!named || host.size() == kLocalhost.size()) return named;
  // A name under it: labels of letters, digits and '-', none empty.
  const auto labels = host.substr(0, host.size() - kLocalhost.size());
  constexpr std::string_view kLabelCharacters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-.";
  return labels.ends_with('.') && !labels.starts_with('.') && labels.find("..") == std::string_view::npos &&
         labels.find_first_not_of(kLabelCharacters) == std::string_view::npos;
}

int parse_port(std::string_view text, std::string_view whole) {
  const auto port = port_number(text);
  if (!port) {
    throw InvalidArgument("--listen: the port must be a number from 0 (any free port) to 65535, in '" +
                          printable(whole) + "'");
  }
  return *port;
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

// Whether a request's Host header names this host's loopback: a page served on loopback only
// answers requests meant for it, not a DNS name rebound to 127.0.0.1 by another site. Read
// strictly, as HOST or HOST:PORT (HOST a name, an IPv4 address or [IPv6]; PORT digits): anything
// else ("127.0.0.1:1@evil.com", a path, spaces, an empty port) is not loopback.
bool host_header_is_loopback(const std::string& host_header) {
  // Only what a host and a port are spelled with: no NUL (the address parser would stop at it),
  // no space, '@', '/' or '%' (a zone id).
  if (host_header.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-:[]") !=
      std::string::npos) {
    return false;
  }
  const std::string_view header = host_header;
  std::string_view host = header, port;
  bool bracketed = false;
  if (header.starts_with('[')) {
    const auto close = header.find(']');
    if (close == std::string_view::npos) return false;
    host = header.substr(1, close - 1);
    const auto rest = header.substr(close + 1);
    if (!rest.empty()) {
      if (!rest.starts_with(':') || rest.size() == 1) return false;
      port = rest.substr(1);
    }
    bracketed = true;
  } else if (const auto colon = header.find(':'); colon != std::string_view::npos) {
    host = header.substr(0, colon);
    port = header.substr(colon + 1);
    if (port.empty()) return false;
  }
  if (!port.empty() && !port_number(port)) return false;
  // Host names are case-insensitive, and "localhost." is the same name, fully qualified.
  if (!bracketed && is_localhost_name(host)) return true;
  // IPv6 only in brackets, IPv4 only without: "[127.0.0.1]" and a bare "::1" are not Host values.
  if (bracketed != (host.find(':') != std::string_view::npos)) return false;
  return is_loopback_address(std::string(host)).value_or(false);
}

std::string address_text(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

}  // namespace turnstile::cli
