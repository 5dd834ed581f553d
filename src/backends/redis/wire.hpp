// SPDX-License-Identifier: Apache-2.0
// The wire under every Redis connection, over hiredis 0.14: close-on-exec sockets, network
// waits that end by a deadline or at once on a stop, replies bounded in size, and the protocol's
// encoding written and read without blocking.
#pragma once

#include <hiredis/hiredis.h>

#include <chrono>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <vector>

#include "backends/redis/settings.hpp"

namespace turnstile::detail::redis {

// Caps on each network wait; each is also bounded by the caller's deadline.
inline constexpr std::chrono::milliseconds kConnectTimeout{2000};
inline constexpr std::chrono::milliseconds kReplyTimeout{5000};
// The most one reply may make us buffer or allocate (a hostile server cannot make us allocate
// without bound; hiredis 0.14 has no limit of its own).
inline constexpr std::size_t kMaxReplyBytes = std::size_t{64} << 20;

struct ReplyDeleter {
  void operator()(redisReply* reply) const { freeReplyObject(reply); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

struct ContextDeleter {
  void operator()(redisContext* context) const;
};
using Context = std::unique_ptr<redisContext, ContextDeleter>;

using Command = std::vector<std::string>;

// An eventfd that becomes readable when `stop` is requested, for poll() (-1 when no stop is
// possible): network waits end at once on it.
class StopFd {
 public:
  explicit StopFd(std::stop_token stop);
  ~StopFd();
  StopFd(const StopFd&) = delete;
  StopFd& operator=(const StopFd&) = delete;
  int fd() const { return fd_; }

 private:
  struct Signal {
    int fd;
    void operator()() const noexcept;
  };
  int fd_ = -1;
  std::optional<std::stop_callback<Signal>> callback_;
};

// The network waits of one call: they end by `until`, the caller's deadline, or at once when
// `stop` is requested (`cancel_fd` is its StopFd). A call whose deadline had already passed when
// it began ("try once") gets one attempt bounded by the caps.
struct Wait {
  explicit Wait(Deadline deadline, std::stop_token stop = {}, int cancel_fd = -1);
  SteadyClock::time_point start;
  bool try_once;
  SteadyClock::time_point until;  // time_point::max() for "no deadline"
  std::stop_token stop;
  int cancel_fd;
  // The caller has other nodes to ask (a cluster's slot map, read from the nodes in turn): a
  // connection that fails (refused: nothing listens), or a node still in its reconnect backoff,
  // ends the call at once rather than being tried again within its share of the time.
  bool fail_fast = false;
  SteadyClock::time_point connect_until() const;
  SteadyClock::time_point reply_until() const;
  bool expired() const { return SteadyClock::now() >= until; }
};

// Replies still owed on a connection for commands sent before (without waiting for them).
struct Earlier {
  std::size_t count = 0;
  std::vector<Reply>* replies = nullptr;  // receives them, in order
};

// Sends every command and reads every reply by `until` (each reply at most kMaxReplyBytes),
// after the `earlier` replies still owed (read into earlier.replies: the server answers in
// order, so ours come after them, and our commands go out before we wait for them).
// Returns "" on success, else what failed (the context is then unusable). `sent` (optional) is
// set when any byte of the commands may have reached the server.
std::string exchange(redisContext* context, const std::vector<Command>& commands, std::vector<Reply>& replies,
                     SteadyClock::time_point until, int cancel_fd = -1, bool* sent = nullptr, Earlier earlier = {});
// Writes all of `out` by `until`; "" or what failed. `sent` (optional) as exchange's.
std::string write_all(redisContext* context, std::string& out, SteadyClock::time_point until, int cancel_fd = -1,
                      bool* sent = nullptr);
// Reads `count` replies by `until` (no command sent); "" or what failed, as exchange.
std::string read_replies(redisContext* context, std::size_t count, std::vector<Reply>& replies,
                         SteadyClock::time_point until, int cancel_fd = -1);

// Appends a command in the protocol's encoding. False when out of memory.
bool append_command(std::string& out, const Command& command);
// Writes what the socket takes now of `out` and removes it (non-blocking; never SIGPIPE).
// False when the connection failed (context->errstr says).
bool write_pending(redisContext* context, std::string& out);
// Reads what the socket has (non-blocking), refusing to buffer more than kMaxReplyBytes of one
// reply. False when the connection failed or the reply is too large (context->errstr says).
bool read_available(redisContext* context);
// The next complete reply already read (null when none yet). False on a protocol error or a
// reply over kMaxReplyBytes.
bool next_reply(redisContext* context, Reply& reply);

// poll()'s timeout for waiting until `until` (-1 for forever), in whole milliseconds rounded up.
int poll_timeout(SteadyClock::time_point until);

// wait_for()'s `why` when `until` came first: the end of every message of a call that ran out
// of time (the factory says a connect that ended so as timed out, and nothing else).
inline constexpr std::string_view kNoAnswerInTime = "no answer in time";

// Waits until `fd` has one of `events` (or an error/hangup), by `until`. False, with `why`, on
// timeout (kNoAnswerInTime) or when `cancel_fd` became readable ("cancelled").
bool wait_for(int fd, short events, SteadyClock::time_point until, int cancel_fd, std::string& why);
// A non-blocking, close-on-exec TCP connection to settings.host:port, made by `until`.
int connect_socket(const Settings& settings, SteadyClock::time_point until, int cancel_fd);
// Makes a new context refuse replies over kMaxReplyBytes.
void bound_replies(redisContext* context);

}  // namespace turnstile::detail::redis
