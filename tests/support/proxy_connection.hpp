// SPDX-License-Identifier: Apache-2.0
// One connection through the test proxy (tests/support/tcp_proxy.cpp): its two sockets, the
// bytes waiting in each direction, and the socket steps the proxy's thread takes on it.
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <optional>
#include <vector>

#include "support/held_requests.hpp"

namespace turnstile_test::detail {

constexpr std::size_t buffer_limit = 64 * 1024;
// How long the server side of a connection whose client is gone stays open once its late
// requests were written: time for the server to execute and answer them.
constexpr std::chrono::seconds orphan_linger{5};
// How long after a delivered request what its client sent after it follows.
constexpr std::chrono::seconds rest_delay{1};

// Closes with a reset rather than a FIN: what a crashed or reset link looks like to the peer.
inline void close_with_reset(int fd) {
  if (fd < 0) return;
  linger option{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &option, sizeof option);
  ::close(fd);
}

// Bytes read from one side, waiting to be written to the other.
struct Buffer {
  std::vector<char> bytes;
  std::size_t space() const { return bytes.size() < buffer_limit ? buffer_limit - bytes.size() : 0; }
  bool empty() const { return bytes.empty(); }
};

struct Connection {
  int client = -1;
  int server = -1;
  bool connect_started = false;  // connected onwards once only: a side lost is not replaced
  bool connecting = false;
  bool client_eof = false;  // the client sent FIN
  bool server_eof = false;
  bool server_shut = false;  // FIN passed on to the server
  bool client_shut = false;
  Buffer up;           // client -> server
  Buffer down;         // server -> client
  RequestWatch watch;  // held and copied requests
  // The client is gone but the server side stays open: its requests were held back (or it
  // sends a replayed copy). Replies are read and discarded; it closes when the server does, or
  // at close_by once everything was delivered.
  bool orphan = false;
  std::optional<Clock::time_point> close_by;
};

inline void kill(Connection& c) {
  close_with_reset(c.client);
  close_with_reset(c.server);
  c.client = c.server = -1;
}

// Reads what `from` has into `into` (bounded); false on EOF (sets eof) or a hard error.
inline bool read_into(int from, Buffer& into, bool& eof) {
  if (into.space() == 0) return true;
  char chunk[buffer_limit];
  const auto n = ::read(from, chunk, into.space());
  if (n > 0) {
    into.bytes.insert(into.bytes.end(), chunk, chunk + n);
    return true;
  }
  if (n == 0) {
    eof = true;
    return true;
  }
  return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
}

inline bool write_from(int to, Buffer& from) {
  const auto n = ::send(to, from.bytes.data(), from.bytes.size(), MSG_NOSIGNAL);
  if (n >= 0) {
    from.bytes.erase(from.bytes.begin(), from.bytes.begin() + n);
    return true;
  }
  return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
}

// A delivery: the held chunk goes out now, the rest of what was kept at rest_due.
inline void deliver_held(Connection& c) {
  auto& kept = c.watch.kept;
  const auto first = kept.begin() + static_cast<std::ptrdiff_t>(std::min(c.watch.first_held, kept.size()));
  c.up.bytes.insert(c.up.bytes.end(), kept.begin(), first);
  kept.erase(kept.begin(), first);
  if (!kept.empty()) c.watch.rest_due = Clock::now() + rest_delay;
}

// Sends the rest of a delivery once it is due.
inline void release_rest_when_due(Connection& c) {
  if (!c.watch.rest_due || Clock::now() < *c.watch.rest_due || !c.watch.holds.empty()) return;
  c.up.bytes.insert(c.up.bytes.end(), c.watch.kept.begin(), c.watch.kept.end());
  c.watch.kept.clear();
  c.watch.rest_due.reset();
}

// A cut link: a side that closed or failed is closed on our side only; the other side learns
// nothing until forwarding resumes. False when the connection is finished.
inline bool serve_cut(Connection& c, short client_revents, short server_revents) {
  if (c.client >= 0 && (client_revents & (POLLERR | POLLHUP | POLLNVAL))) {
    ::close(c.client);
    c.client = -1;
  }
  if (c.server >= 0 && (server_revents & (POLLERR | POLLHUP | POLLNVAL))) {
    ::close(c.server);
    c.server = -1;
  }
  return c.client >= 0 || c.server >= 0;
}

// A non-blocking connect onwards finished: false (the connection killed) when it failed.
inline bool connected(Connection& c) {
  int error = 0;
  socklen_t size = sizeof error;
  ::getsockopt(c.server, SOL_SOCKET, SO_ERROR, &error, &size);
  if (error != 0) {
    kill(c);
    return false;
  }
  c.connecting = false;
  return true;
}

// The client is gone. A connection keeping requests back stays open to the server (so they
// can still be delivered late); any other is finished (false).
inline bool become_orphan(Connection& c) {
  if (!c.watch.keeps() || c.server < 0) {
    kill(c);
    return false;
  }
  if (c.client >= 0) ::close(c.client);
  c.client = -1;
  c.orphan = true;
  c.down.bytes.clear();
  return true;
}

}  // namespace turnstile_test::detail
