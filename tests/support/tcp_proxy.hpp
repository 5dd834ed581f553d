// SPDX-License-Identifier: Apache-2.0
// A loopback TCP proxy for tests of network failures: it listens on 127.0.0.1:<free port> and
// forwards every connection to one target, with modes switched at run time to simulate a cut
// link (black hole), lost replies, and connection resets. One poll() thread serves all
// connections; buffers are bounded (a full buffer stops reading, as TCP would).
//
// Mode changes are synchronous: when a setter returns, the proxy's thread has seen the new mode,
// so no byte moves under the old one afterwards.
//
// Late requests (tests/support/held_requests.hpp): a request held back and delivered after its
// sender gave up, or copied and sent again, to test that a write its sender gave up on changes
// nothing.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "support/held_requests.hpp"

namespace turnstile_test {

class TcpProxy {
 public:
  enum class Mode {
    // Bytes flow both ways.
    forward,
    // A cut link: nothing is read or written in either direction, every socket stays open (no
    // FIN, no RST), and new connections are accepted but not connected onwards. Bytes already
    // buffered are delivered when forwarding resumes (as TCP retransmits after a link heals).
    blackhole,
    // Client-to-server bytes flow; server-to-client bytes are read and discarded ("the request
    // was applied, its reply was lost").
    drop_replies,
    // Client-to-server bytes flow; server-to-client bytes wait (in the kernel's buffers) until
    // pass_one_reply() lets one chunk through, or another mode drops (drop_replies) or delivers
    // (forward) them. To lose exactly the reply of a request that comes after other round trips:
    // pass replies one by one until the server shows the request applied, then drop_replies().
    hold_replies,
  };

  // Forwards to host:port (resolved once, now).
  TcpProxy(const std::string& host, std::uint16_t port);
  // Forwards to the first host:port of a backend URL (scheme://[userinfo@]host[:port][,...]/...;
  // a missing port is the scheme's default).
  explicit TcpProxy(const std::string& backend_url);
  ~TcpProxy();  // shutdown()
  TcpProxy(const TcpProxy&) = delete;
  TcpProxy& operator=(const TcpProxy&) = delete;

  // The port it listens on (127.0.0.1).
  std::uint16_t port() const;
  // `backend_url` with its host list replaced by 127.0.0.1:port() (user info, path and query
  // kept): a client connected with it talks to the server through this proxy.
  std::string url_through(const std::string& backend_url) const;

  void set_mode(Mode mode);
  Mode mode() const;
  void forward() { set_mode(Mode::forward); }
  void blackhole() { set_mode(Mode::blackhole); }
  void drop_replies() { set_mode(Mode::drop_replies); }
  void hold_replies() { set_mode(Mode::hold_replies); }
  // In hold_replies: delivers the next chunk of replies read on any connection (one read(), up
  // to 64 KiB); false when none came within `wait` (or not in hold_replies).
  bool pass_one_reply(std::chrono::milliseconds wait);
  // Forwards, except that the next chunk of server-to-client bytes read on any connection (one
  // read(), up to 64 KiB: typically one reply) is discarded; then it forwards everything.
  void drop_next_reply();
  // Black-holes the link at a moment when no client-to-server bytes have passed for `quiet`
  // (retrying for up to `timeout`) and returns that moment, the cut. Every request the server
  // got before the cut, a renewal included, was then sent at least `quiet` before it: a test
  // can assert a bound counted from the cut with `quiet` of room for scheduling. Throws
  // std::runtime_error when no quiet moment came in time.
  std::chrono::steady_clock::time_point blackhole_when_quiet(
      std::chrono::milliseconds quiet, std::chrono::milliseconds timeout = std::chrono::seconds(10));
  // When client-to-server bytes were last read (forwarded or not).
  std::chrono::steady_clock::time_point last_request_at() const;
  // Closes every current connection on both sides with a reset (RST); new connections are
  // accepted and handled by the current mode.
  void reset();
  // Stops the thread and closes every socket (idempotent; joins).
  void shutdown();

  // Arms a hold: the nth (1-based) client-to-server chunk containing `pattern` (a byte string,
  // matched also across chunk boundaries of one connection) is held with the rest of its
  // connection's requests. Several holds may be armed at once. Chunks are counted from now on.
  std::shared_ptr<HeldRequest> hold_request(const std::string& pattern, int nth = 1);
  // The nth chunk containing `pattern` is forwarded as usual AND copied: replay() sends the
  // copy on a NEW server-side connection (its reply is discarded), as a client's resend would.
  // Only the chunk is copied: it suits protocols with one request per connection-independent
  // message (RESP, HTTP/1.1), not HTTP/2 (etcd: hold the first copy and deliver it instead).
  std::shared_ptr<DuplicatedRequest> duplicate_request(const std::string& pattern, int nth = 1);

  // Connections currently open (either side), and accepted since construction.
  std::size_t open_connections() const;
  std::uint64_t accepted() const;
  // Server-to-client bytes discarded by drop_replies / drop_next_reply.
  std::uint64_t dropped_bytes() const;

  // The first host and port of a backend URL (the scheme's default port when none is given).
  static std::pair<std::string, std::uint16_t> endpoint_of(const std::string& backend_url);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace turnstile_test
