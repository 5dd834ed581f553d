// SPDX-License-Identifier: Apache-2.0
#include <cctype>
#include <charconv>
#include <cstdio>

#include "core/text_escape.hpp"
#include "core/url.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail {
namespace {

// A URL part with its %XX escapes decoded; a malformed escape is an InvalidUrl naming the URL.
std::string url_part(std::string_view text, std::string_view whole) {
  auto decoded = percent_decode(text);
  if (!decoded) throw InvalidUrl("bad percent-escape in '" + std::string(whole) + "'");
  return std::move(*decoded);
}

bool secret_parameter(std::string_view key) {
  for (std::string_view secret : {"password", "pass", "token", "secret", "auth", "credentials"}) {
    // sentinel_password, and any other <something>_password
    if (key == secret ||
        (key.size() > secret.size() && key.ends_with(secret) && key[key.size() - secret.size() - 1] == '_')) {
      return true;
    }
  }
  return false;
}

// Where the userinfo of `text` ends (its '@'), or npos. The last '@' ends it, so a password may
// hold an unencoded '/', '?', '#' or '@'; an '@' in a query value must then be written %40.
// file:// has no userinfo (a path may hold '@').
std::size_t userinfo_end(std::string_view text, std::size_t authority_start, std::string_view scheme) {
  if (scheme == "file") return std::string_view::npos;
  const auto at = text.rfind('@');
  return at == std::string_view::npos || at < authority_start ? std::string_view::npos : at;
}

}  // namespace

std::string redact_url(std::string_view text) {
  const auto scheme_end = text.find("://");
  const auto authority_start = scheme_end == std::string_view::npos ? 0 : scheme_end + 3;
  const auto scheme = text.substr(0, scheme_end == std::string_view::npos ? 0 : scheme_end);
  std::string out(text.substr(0, authority_start));
  // A userinfo without ':' is a password or token on some schemes (redis://PASSWORD@,
  // consul://TOKEN@): all of it is hidden.
  const auto at = userinfo_end(text, authority_start, scheme);
  auto host_start = authority_start;
  if (at != std::string_view::npos) {
    const auto userinfo = text.substr(authority_start, at - authority_start);
    const auto colon = userinfo.find(':');
    // consul://TOKEN@: a ':' in a token does not make what comes before it a user name.
    std::string lowered(scheme);
    for (char& c : lowered) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    const bool token = lowered == "consul" || lowered == "consuls";
    out.append(colon == std::string_view::npos || token ? std::string_view("***") : userinfo.substr(0, colon));
    if (colon != std::string_view::npos && !token) out.append(":***");
    out += '@';
    host_start = at + 1;
  }
  auto authority_end = text.find_first_of("/?#", host_start);
  if (authority_end == std::string_view::npos) authority_end = text.size();
  out.append(text.substr(host_start, authority_end - host_start));
  auto rest = text.substr(authority_end);
  const auto q = rest.find('?');
  out.append(rest.substr(0, q));
  if (q == std::string_view::npos) return out;
  auto query = rest.substr(q + 1);
  out += '?';
  for (bool first = true;; first = false) {
    const auto amp = query.find_first_of("&#");
    const auto pair = query.substr(0, amp);
    if (!first) out += '&';
    const auto eq = pair.find('=');
    if (eq != std::string_view::npos && secret_parameter(pair.substr(0, eq))) {
      out.append(pair.substr(0, eq + 1)).append("***");
    } else {
      out.append(pair);
    }
    if (amp == std::string_view::npos) break;
    if (query[amp] == '#') {
      out.append(query.substr(amp));
      break;
    }
    query = query.substr(amp + 1);
  }
  return out;
}

BackendUrl parse_url(std::string_view raw) {
  BackendUrl url;
  url.text = redact_url(raw);
  // Parsed from the raw text; every message names url.text, the redacted form.
  const std::string_view text = raw;
  const std::string_view shown = url.text;
  const auto fail = [&](const std::string& why) -> void {
    throw InvalidUrl("malformed backend URL '" + url.text + "': " + why);
  };
  const auto scheme_end = text.find("://");
  if (scheme_end == std::string_view::npos || scheme_end == 0) fail("expected scheme://...");
  url.scheme = std::string(text.substr(0, scheme_end));
  for (char& c : url.scheme) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '+' && c != '-' && c != '.') fail("bad scheme");
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  auto rest = text.substr(scheme_end + 3);
  // The userinfo first, by the same rule as redact_url: a password never reaches the parsing
  // (and the messages) of the host, path or query.
  if (const auto at = userinfo_end(rest, 0, url.scheme); at != std::string_view::npos) {
    const auto userinfo = rest.substr(0, at);
    rest = rest.substr(at + 1);
    const auto colon = userinfo.find(':');
    url.user = url_part(userinfo.substr(0, colon), shown);
    if (colon != std::string_view::npos) url.password = url_part(userinfo.substr(colon + 1), shown);
  }
  if (const auto hash = rest.find('#'); hash != std::string_view::npos) fail("fragments are not allowed");
  if (const auto q = rest.find('?'); q != std::string_view::npos) {
    auto query = rest.substr(q + 1);
    rest = rest.substr(0, q);
    while (!query.empty()) {
      const auto amp = query.find('&');
      const auto pair = query.substr(0, amp);
      const auto eq = pair.find('=');
      if (eq == std::string_view::npos || eq == 0) fail("query parameters must be key=value");
      // An option given twice is refused: silently keeping one of them would ignore the other.
      const auto key = url_part(pair.substr(0, eq), shown);
      if (!url.query.emplace(key, url_part(pair.substr(eq + 1), shown)).second) {
        fail("the query parameter '" + key + "' is given more than once");
      }
      if (amp == std::string_view::npos) break;
      query = query.substr(amp + 1);
    }
  }
  const auto slash = rest.find('/');
  auto authority = rest.substr(0, slash);
  if (slash != std::string_view::npos) url.path = url_part(rest.substr(slash), shown);
  while (!authority.empty()) {
    const auto comma = authority.find(',');
    const auto host = authority.substr(0, comma);
    if (host.empty()) fail("empty host in host list");
    for (char c : host) {
      if (std::isspace(static_cast<unsigned char>(c))) fail("spaces in host");
    }
    url.hosts.emplace_back(host);
    if (comma == std::string_view::npos) break;
    authority = authority.substr(comma + 1);
  }
  return url;
}

bool valid_host(std::string_view host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    const auto address = host.substr(1, host.size() - 2);
    return address.find(':') != std::string_view::npos &&
           address.find_first_not_of("0123456789abcdefABCDEF:.") == std::string_view::npos;
  }
  if (host.empty() || host.size() > 253) return false;
  for (char c : host) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' && c != '_') return false;
  }
  return true;
}

HostPort parse_host_port(const std::string& text, int default_port, const BackendUrl& url) {
  HostPort result;
  // An IPv6 address is bracketed ([::1]:6379): the port's ':' is the one after the ']'.
  const auto bracket = text.starts_with('[') ? text.find(']') : std::string::npos;
  const auto colon =
      text.starts_with('[') ? (bracket == std::string::npos ? bracket : text.find(':', bracket)) : text.rfind(':');
  result.host = text.substr(0, colon);
  if (result.host.empty()) throw InvalidUrl("no host in '" + url.text + "'");
  if (!valid_host(result.host) ||
      (bracket != std::string::npos && colon == std::string::npos && bracket + 1 != text.size())) {
    throw InvalidUrl("bad host '" + result.host + "' in '" + url.text +
                     "' (a name, an IPv4 address or [an IPv6 address])");
  }
  if (colon == std::string::npos) {
    if (default_port == 0) throw InvalidUrl("expected host:port, got '" + text + "' in '" + url.text + "'");
    result.port = default_port;
    return result;
  }
  const auto port_text = text.substr(colon + 1);
  const auto [end, error] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), result.port);
  if (error != std::errc() || end != port_text.data() + port_text.size() || result.port <= 0 || result.port > 65535) {
    throw InvalidUrl("bad port '" + port_text + "' in '" + url.text + "'");
  }
  return result;
}

std::chrono::milliseconds parse_seconds(const std::string& parameter, const std::string& value, double min,
                                        double max) {
  double seconds = 0;
  const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), seconds);
  if (error != std::errc() || end != value.data() + value.size() || !(seconds >= min) || seconds > max) {
    char range[64];
    std::snprintf(range, sizeof range, "between %g and %g seconds", min, max);
    throw InvalidUrl(parameter + " must be " + range + ", got '" + value + "'");
  }
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
}

void check_ttl_option(std::chrono::milliseconds ttl, double min, double max) {
  if (ttl.count() <= 0) return;
  const double seconds = static_cast<double>(ttl.count()) / 1000;
  if (seconds >= min && seconds <= max) return;
  char range[96];
  std::snprintf(range, sizeof range, "between %g and %g seconds, got %g", min, max, seconds);
  throw InvalidArgument(std::string("ttl must be ") + range);
}

}  // namespace turnstile::detail
