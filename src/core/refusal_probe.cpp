// SPDX-License-Identifier: Apache-2.0
#include "core/refusal_probe.hpp"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

namespace turnstile::detail {
namespace {

// The sockets of one probe, closed when it ends.
class ProbeSockets {
 public:
  ProbeSockets() = default;
  ~ProbeSockets() {
    for (const int fd : opened_) ::close(fd);
  }
  ProbeSockets(const ProbeSockets&) = delete;
  ProbeSockets& operator=(const ProbeSockets&) = delete;

  // Connections not answered yet; an answered one's fd becomes -1 (poll skips it).
  std::vector<pollfd>& pending() { return pending_; }

  // Starts connecting to `address`; false when it is not refused and not pending either (it
  // accepted at once, or failed otherwise): then something might answer.
  bool start(const addrinfo& address, bool& refused_once) {
    const int fd = ::socket(address.ai_family, address.ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    // An address of a family this host cannot use (::1 without IPv6) is nobody's answer.
    if (fd < 0) return errno == EAFNOSUPPORT;
    opened_.push_back(fd);
    if (::connect(fd, address.ai_addr, address.ai_addrlen) == 0) return false;
    const int error = errno;
    if (error == EINPROGRESS) {
      pending_.push_back({fd, POLLOUT, 0});
      return true;
    }
    if (error != ECONNREFUSED) return false;
    refused_once = true;
    return true;
  }

 private:
  std::vector<int> opened_;
  std::vector<pollfd> pending_;
};

// "host:port" or "[v6]:port" as getaddrinfo's node and service; false when it is neither.
bool split_host_port(const std::string& server, std::string& host, std::string& port) {
  const auto colon = server.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == server.size()) return false;
  host = server.substr(0, colon);
  port = server.substr(colon + 1);
  if (host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return !host.empty();
}

using Addresses = std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)>;

// One name's resolution, shared by the caller and the thread that runs it.
struct Resolution {
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;
  bool abandoned = false;  // the caller stopped waiting: the thread frees the answer
  addrinfo* found = nullptr;
};

// The addresses of host:port, or none. A numeric host is parsed at once; a name is resolved in
// a thread of its own, because getaddrinfo cannot be interrupted and a DNS server that does not
// answer would hold the caller past `until`: then the thread is left to finish on its own.
Addresses resolve(const std::string& host, const std::string& port, SteadyClock::time_point until) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | AI_NUMERICHOST;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &found) == 0) return {found, &::freeaddrinfo};
  hints.ai_flags = AI_NUMERICSERV;
  auto resolution = std::make_shared<Resolution>();
  std::thread([resolution, host, port, hints] {
    addrinfo* answer = nullptr;
    if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &answer) != 0) answer = nullptr;
    std::lock_guard lock(resolution->mutex);
    if (resolution->abandoned) {
      if (answer) ::freeaddrinfo(answer);
      return;
    }
    resolution->found = answer;
    resolution->done = true;
    resolution->done_cv.notify_all();
  }).detach();
  std::unique_lock lock(resolution->mutex);
  if (!resolution->done_cv.wait_until(lock, until, [&] { return resolution->done; })) {
    resolution->abandoned = true;
    return {nullptr, &::freeaddrinfo};
  }
  return {resolution->found, &::freeaddrinfo};
}

// Starts connecting to every address of `server`; false when it might answer.
bool start_server(const std::string& server, ProbeSockets& sockets, bool& refused_once, SteadyClock::time_point until) {
  std::string host, port;
  if (!split_host_port(server, host, port)) return false;
  const auto found = resolve(host, port, until);
  if (!found) return false;
  bool refused = true;
  for (const addrinfo* address = found.get(); address && refused; address = address->ai_next) {
    refused = sockets.start(*address, refused_once);
  }
  return refused;
}

// Waits for the connections still pending: false as soon as one is not refused.
bool pending_all_refused(std::vector<pollfd>& pending, SteadyClock::time_point until, bool& refused_once) {
  while (std::any_of(pending.begin(), pending.end(), [](const pollfd& p) { return p.fd >= 0; })) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - SteadyClock::now()).count();
    if (left <= 0) return false;  // no answer yet: it might still come
    const int ready = ::poll(pending.data(), pending.size(), static_cast<int>(std::min<long long>(left, 60'000)));
    if (ready < 0 && errno != EINTR) return false;
    for (auto& entry : pending) {
      if (entry.fd < 0 || entry.revents == 0) continue;
      int error = 0;
      socklen_t length = sizeof error;
      if (::getsockopt(entry.fd, SOL_SOCKET, SO_ERROR, &error, &length) != 0 || error != ECONNREFUSED) return false;
      entry.fd = -1;  // refused: poll skips it from now on
      refused_once = true;
    }
  }
  return true;
}

}  // namespace

bool every_server_refuses(const std::vector<std::string>& servers, SteadyClock::time_point until) {
  ProbeSockets sockets;
  bool refused_once = false;
  for (const auto& server : servers) {
    if (!start_server(server, sockets, refused_once, until)) return false;
  }
  // Refused needs one refusal at least: a list of addresses none of which this host can use
  // is no answer.
  return pending_all_refused(sockets.pending(), until, refused_once) && refused_once;
}

std::vector<std::string> split_server_list(const std::string& list) {
  std::vector<std::string> servers;
  for (std::size_t start = 0; start <= list.size();) {
    const auto comma = std::min(list.find(',', start), list.size());
    if (comma > start) servers.push_back(list.substr(start, comma - start));
    start = comma + 1;
  }
  return servers;
}

}  // namespace turnstile::detail
