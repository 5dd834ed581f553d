// SPDX-License-Identifier: Apache-2.0
// TcpProxy's URL helpers: which server a backend URL names, and the URL that goes through the
// proxy instead.
#include <algorithm>
#include <stdexcept>

#include "support/tcp_proxy.hpp"

namespace turnstile_test {

namespace {

std::uint16_t default_port(const std::string& scheme) {
  if (scheme == "redis" || scheme == "rediss") return 6379;
  if (scheme == "zookeeper" || scheme == "zk") return 2181;
  if (scheme == "etcd" || scheme == "etcds") return 2379;
  throw std::invalid_argument("TcpProxy: no default port for scheme '" + scheme + "'");
}

// The positions of a URL's host list: [begin, end) after "scheme://" and any user info.
std::pair<std::size_t, std::size_t> host_list_span(const std::string& url) {
  const auto scheme_end = url.find("://");
  if (scheme_end == std::string::npos) throw std::invalid_argument("TcpProxy: not a URL: no scheme");
  const auto begin = scheme_end + 3;
  const auto end = std::min(url.find('/', begin), url.find('?', begin));
  const auto authority_end = end == std::string::npos ? url.size() : end;
  const auto at = url.rfind('@', authority_end == 0 ? 0 : authority_end - 1);
  const auto hosts_begin = (at != std::string::npos && at >= begin) ? at + 1 : begin;
  return {hosts_begin, authority_end};
}

}  // namespace

std::pair<std::string, std::uint16_t> TcpProxy::endpoint_of(const std::string& backend_url) {
  const auto [begin, end] = host_list_span(backend_url);
  auto first = backend_url.substr(begin, end - begin);
  first = first.substr(0, first.find(','));
  const auto scheme = backend_url.substr(0, backend_url.find("://"));
  std::string host = first;
  std::string port;
  if (!first.empty() && first.front() == '[') {
    const auto close = first.find(']');
    if (close == std::string::npos) throw std::invalid_argument("TcpProxy: bad IPv6 host");
    host = first.substr(1, close - 1);
    if (close + 1 < first.size() && first[close + 1] == ':') port = first.substr(close + 2);
  } else if (const auto colon = first.rfind(':'); colon != std::string::npos) {
    host = first.substr(0, colon);
    port = first.substr(colon + 1);
  }
  if (host.empty()) throw std::invalid_argument("TcpProxy: the URL has no host");
  return {host, port.empty() ? default_port(scheme) : static_cast<std::uint16_t>(std::stoi(port))};
}

std::string TcpProxy::url_through(const std::string& backend_url) const {
  const auto [begin, end] = host_list_span(backend_url);
  return backend_url.substr(0, begin) + "127.0.0.1:" + std::to_string(port()) + backend_url.substr(end);
}

}  // namespace turnstile_test
