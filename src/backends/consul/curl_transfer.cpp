// SPDX-License-Identifier: Apache-2.0
#include "backends/consul/curl_transfer.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>

namespace turnstile::detail::consul {
namespace {

// How long a connection attempt may take at most within a call's own timeout.
constexpr std::chrono::milliseconds kConnectTimeout{3000};

curl_socket_t open_cloexec(void*, curlsocktype, curl_sockaddr* address) {
  return ::socket(address->family, address->socktype | SOCK_CLOEXEC, address->protocol);
}

std::set<int> open_descriptors() {
  std::set<int> fds;
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return fds;
  while (const dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') fds.insert(std::atoi(entry->d_name));
  }
  fds.erase(dirfd(dir));
  closedir(dir);
  return fds;
}

bool unix_socket(int fd) {
  int domain = 0;
  socklen_t size = sizeof domain;
  return getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &size) == 0 && domain == AF_UNIX;
}

std::size_t on_body(char* data, std::size_t size, std::size_t count, void* out) {
  static_cast<std::string*>(out)->append(data, size * count);
  return size * count;
}

// The value of header `name` (lower case, with its colon) in `line`, if it is that header.
std::optional<std::uint64_t> header_number(std::string_view line, std::string_view name) {
  if (line.size() <= name.size()) return std::nullopt;
  std::string lower(line.substr(0, name.size()));
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower != name) return std::nullopt;
  return std::strtoull(std::string(line.substr(name.size())).c_str(), nullptr, 10);
}

// X-Consul-Index, and Content-Length to size the body once: a queue of thousands is a few MB,
// which appending piece by piece would grow to twice that.
std::size_t on_header(char* data, std::size_t size, std::size_t count, void* out) {
  auto& reply = *static_cast<Reply*>(out);
  const std::string_view line(data, size * count);
  constexpr std::uint64_t kReservedAtMost = 64u << 20;
  if (const auto index = header_number(line, "x-consul-index:")) reply.index = *index;
  if (const auto length = header_number(line, "content-length:"); length && *length <= kReservedAtMost) {
    reply.body.reserve(static_cast<std::size_t>(*length));
  }
  return size * count;
}

}  // namespace

// libcurl (7.88, Debian 12) makes each multi handle's wake-up socketpair without SOCK_CLOEXEC
// and offers no option for it: the Unix sockets that curl_multi_init added are marked here, so a
// program's children (`turnstile run`'s command) inherit none. Our own multis are made one at a
// time; a descriptor another thread opened meanwhile is touched only if it is a Unix socket
// without close-on-exec, which the library's rules forbid anyway.
CURLM* new_multi() {
  static std::mutex making;
  std::lock_guard lock(making);
  const auto before = open_descriptors();
  CURLM* multi = curl_multi_init();
  for (const int fd : open_descriptors()) {
    if (before.count(fd) || !unix_socket(fd)) continue;
    const int flags = fcntl(fd, F_GETFD);
    if (flags >= 0 && !(flags & FD_CLOEXEC)) fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
  }
  return multi;
}

void prepare(Transfer& transfer, const Endpoint& endpoint, const Request& request, std::chrono::milliseconds timeout) {
  CURL* easy = transfer.easy;
  curl_easy_reset(easy);
  std::string url = endpoint.base + request.path;
  if (!endpoint.dc.empty()) url += (request.path.find('?') == std::string::npos ? "?dc=" : "&dc=") + endpoint.dc;
  curl_slist_free_all(transfer.headers);
  transfer.headers = nullptr;
  if (!endpoint.token.empty()) {
    transfer.headers = curl_slist_append(transfer.headers, ("X-Consul-Token: " + endpoint.token).c_str());
  }
  transfer.headers = curl_slist_append(transfer.headers, "Content-Type: application/json");
  curl_easy_setopt(easy, CURLOPT_URL, url.c_str());  // strings are copied, but for POSTFIELDS
  curl_easy_setopt(easy, CURLOPT_CUSTOMREQUEST, request.method.c_str());
  if (request.method != "GET") {
    curl_easy_setopt(easy, CURLOPT_POSTFIELDS, request.body.c_str());
    curl_easy_setopt(easy, CURLOPT_POSTFIELDSIZE, static_cast<long>(request.body.size()));
  }
  curl_easy_setopt(easy, CURLOPT_HTTPHEADER, transfer.headers);
  curl_easy_setopt(easy, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(easy, CURLOPT_TIMEOUT_MS, static_cast<long>(std::max<long long>(timeout.count(), 1)));
  curl_easy_setopt(easy, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(std::min(timeout, kConnectTimeout).count()) + 1);
  curl_easy_setopt(easy, CURLOPT_OPENSOCKETFUNCTION, open_cloexec);
  curl_easy_setopt(easy, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(easy, CURLOPT_WRITEDATA, &transfer.reply.body);
  curl_easy_setopt(easy, CURLOPT_HEADERFUNCTION, on_header);
  curl_easy_setopt(easy, CURLOPT_HEADERDATA, &transfer.reply);
  if (!endpoint.cacert.empty()) curl_easy_setopt(easy, CURLOPT_CAINFO, endpoint.cacert.c_str());
}

}  // namespace turnstile::detail::consul
