// SPDX-License-Identifier: Apache-2.0
// Late requests for the test proxy (tests/support/tcp_proxy.hpp): a request held back and
// delivered after its sender gave up, and a request copied and sent again, as a client's resend
// would be. Obtained from TcpProxy::hold_request and TcpProxy::duplicate_request; they stay
// usable (as no-ops) after the proxy is gone.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace turnstile_test {

namespace detail {
struct ProxyControl;
struct HoldRecord;
struct CopyRecord;
}  // namespace detail

// A request held back by the proxy.
class HeldRequest {
 public:
  HeldRequest(std::shared_ptr<detail::ProxyControl> control, std::shared_ptr<detail::HoldRecord> record)
      : control_(std::move(control)), record_(std::move(record)) {}

  // True once a client-to-server chunk containing the pattern arrived (the nth such chunk,
  // counted over all connections since hold_request): from that chunk on, everything the
  // client sends on THAT connection is kept back (other connections, and replies, flow).
  bool wait_held(std::chrono::milliseconds timeout);
  bool held() const;
  // Sends everything kept back to the server and lets the connection flow again: the held
  // chunk at once, what the client sent after it 1 s later (a client's cancel or close must not
  // overtake its late request: over HTTP/2 it would cancel the request on arrival). If the
  // client closed its side meanwhile, the server side stays open until the server closes it
  // or 5 s pass (so the server still executes and answers the late request; the answer is
  // discarded). Before anything was held it disarms the hold.
  void deliver();
  // deliver(), once a later client-to-server chunk containing `later_pattern` has been
  // forwarded on another connection AND a reply to it came back (returns false on timeout,
  // delivering nothing).
  bool deliver_after(const std::string& later_pattern, std::chrono::milliseconds timeout);
  // Throws the kept-back bytes away and resets both sides of that connection (or disarms).
  void drop();
  // Resets the client's side of the held connection, as a broken link would, and keeps its
  // server side and the kept-back bytes for deliver(): the client learns at once that its
  // request failed, and resends it on a new connection while the first copy is still held.
  // (Beyond the interface the lead published: an addition, nothing changed.)
  void cut_client();

 private:
  // Forgets a hold that has not matched yet (the proxy's mutex held): true when it had not.
  bool disarm();

  std::shared_ptr<detail::ProxyControl> control_;
  std::shared_ptr<detail::HoldRecord> record_;
};

// A request forwarded as usual and copied, to be sent again later.
class DuplicatedRequest {
 public:
  DuplicatedRequest(std::shared_ptr<detail::ProxyControl> control, std::shared_ptr<detail::CopyRecord> record)
      : control_(std::move(control)), record_(std::move(record)) {}

  // True once the chunk to copy passed (the nth containing the pattern).
  bool wait_seen(std::chrono::milliseconds timeout);
  // Sends the copy on a NEW server-side connection (its reply is discarded) and returns once it
  // is written; the server side then stays open as after HeldRequest::deliver. Throws
  // std::logic_error before the copy was seen, std::runtime_error when it could not be written
  // within 5 s.
  void replay();

 private:
  std::shared_ptr<detail::ProxyControl> control_;
  std::shared_ptr<detail::CopyRecord> record_;
};

namespace detail {

using Clock = std::chrono::steady_clock;

struct HoldRecord {
  enum class Phase { armed, held, deliver_requested, delivered, drop_requested, dropped, disarmed };
  std::string pattern;
  int nth = 1;
  int seen = 0;
  Phase phase = Phase::armed;
  std::uint64_t connection = 0;  // the held connection's id
  bool cut_requested = false;    // cut_client(), not acted on yet
};

struct CopyRecord {
  std::string pattern;
  int nth = 1;
  int seen = 0;
  bool captured = false;
  std::string bytes;
  std::uint64_t replays_requested = 0;
  std::uint64_t replays_written = 0;
  std::uint64_t replays_failed = 0;
};

// deliver_after's watch for the later request and its reply.
struct LaterRecord {
  std::string pattern;
  std::uint64_t not_on = 0;  // the held connection
  bool forwarded = false;
  bool answered = false;
};

// Per proxied connection, client-to-server: what it matched and what it keeps back.
struct RequestWatch {
  std::uint64_t id = 0;
  std::string tail;                                // the last bytes read, for patterns that span chunks
  std::vector<std::shared_ptr<HoldRecord>> holds;  // unresolved holds on this connection
  std::vector<char> kept;                          // bytes kept back
  std::size_t first_held = 0;                      // of which the chunk that matched
  // Delivered: the held chunk went out; what the client sent after it (a cancel, a close, more
  // requests) follows at rest_due, as it was sent later too.
  std::optional<Clock::time_point> rest_due;
  std::shared_ptr<LaterRecord> awaiting_reply;  // a later request forwarded here
  std::shared_ptr<CopyRecord> replay_of;        // this connection sends a replayed copy
  bool keeps() const { return !holds.empty() || rest_due.has_value(); }
};

// What the proxy's thread does to a connection after the requests made to it.
enum class Settle { nothing, deliver, drop, cut_client };

// The proxy's synchronisation with its callers, shared with the HeldRequest and
// DuplicatedRequest handed out (so they outlive the proxy safely), plus the armed holds and
// copies. Every member is guarded by `mutex`.
struct ProxyControl {
  std::mutex mutex;
  std::condition_variable seen;
  int wake = -1;                // eventfd of the proxy's thread
  std::uint64_t requested = 0;  // bumped by every request to the thread
  std::uint64_t observed = 0;   // the last request the thread has acted on
  bool stopped = false;

  std::vector<std::shared_ptr<HoldRecord>> armed;
  std::vector<std::shared_ptr<CopyRecord>> copies;  // until captured
  std::vector<std::shared_ptr<LaterRecord>> laters;
  std::vector<std::shared_ptr<CopyRecord>> replays;  // replays requested, not yet started

  // Asks the thread to act on the current settings and waits until it has (or has stopped).
  void request(std::unique_lock<std::mutex>& lock);

  // The thread's side (mutex held). A client-to-server chunk read on `watch`'s connection:
  // true when it is to be kept back.
  bool on_request_chunk(RequestWatch& watch, std::string_view chunk);
  // Server-to-client bytes arrived on the connection.
  void on_reply(RequestWatch& watch);
  // What the requests made since the last look ask of this connection.
  Settle settle(RequestWatch& watch);
};

}  // namespace detail
}  // namespace turnstile_test
