// SPDX-License-Identifier: Apache-2.0
// Backend URLs: parsing, credential redaction, and the host:port and seconds parsers every
// network backend shares (url.cpp).
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace turnstile::detail {

// A parsed backend URL: scheme://[user[:password]@]host:port[,host:port...][/path][?k=v&...]
struct BackendUrl {
  std::string text;  // as written, but with credentials replaced by *** (safe for messages)
  std::string scheme;
  std::string user;
  std::string password;
  std::vector<std::string> hosts;  // "host:port" as written
  std::string path;                // percent-decoded, starts with '/' when present
  std::map<std::string, std::string> query;
};

// Throws InvalidUrl naming what is wrong (with credentials redacted).
BackendUrl parse_url(std::string_view text);

// A URL as it may be shown: the password of user:password@, a userinfo that is a token alone
// (consul://TOKEN@host), and the values of secret-looking query parameters become ***.
// Works on malformed URLs too, so no message ever carries a credential.
std::string redact_url(std::string_view text);

// One "host[:port]" of a URL's host list, the port checked (1 to 65535); `default_port` when
// none is written (0: a port is required). Throws InvalidUrl naming the URL.
struct HostPort {
  std::string host;
  int port = 0;
};
// host[:port] or [IPv6][:port]; the host is checked (a name, an IPv4 address or a bracketed
// IPv6 address, brackets kept). Throws InvalidUrl.
HostPort parse_host_port(const std::string& text, int default_port, const BackendUrl& url);
bool valid_host(std::string_view host);

// A query parameter given in (possibly fractional) seconds, between `min` and `max` seconds.
// Throws InvalidUrl naming the parameter.
std::chrono::milliseconds parse_seconds(const std::string& parameter, const std::string& value, double min, double max);
// The same range for a TTL given as ClientOptions::ttl (or --ttl), so that a URL and the options
// accept the same values: InvalidArgument when `ttl` is set (above 0) and outside [min, max].
void check_ttl_option(std::chrono::milliseconds ttl, double min, double max = 86400);

}  // namespace turnstile::detail
