// SPDX-License-Identifier: Apache-2.0
#include "backends/redis/subscriber.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace turnstile::detail::redis {

namespace {
constexpr auto kIdleLinger = std::chrono::seconds(30);
constexpr auto kFirstBackoff = std::chrono::milliseconds(50);
constexpr auto kMaxBackoff = std::chrono::milliseconds(2000);

void drain(int fd) {
  std::uint64_t count;
  [[maybe_unused]] auto got = read(fd, &count, sizeof count);
}

bool is_string(const redisReply* reply) {
  return reply && (reply->type == REDIS_REPLY_STRING || reply->type == REDIS_REPLY_STATUS) && reply->str;
}
}  // namespace

Subscriber::Subscriber(Settings settings, Events events, std::function<std::vector<SentinelAddress>()> cluster_nodes)
    : settings_(std::move(settings)), events_(std::move(events)), cluster_nodes_(std::move(cluster_nodes)) {
  event_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  stop_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (event_fd_ < 0 || stop_fd_ < 0) {
    if (event_fd_ >= 0) close(event_fd_);
    if (stop_fd_ >= 0) close(stop_fd_);
    throw BackendUnavailable("eventfd failed");
  }
  thread_ = std::jthread([this](std::stop_token stop) { loop(stop); });
}

Subscriber::~Subscriber() {
  thread_.request_stop();
  const std::uint64_t one = 1;
  [[maybe_unused]] auto written = write(stop_fd_, &one, sizeof one);
  if (thread_.joinable()) thread_.join();
  close(event_fd_);
  close(stop_fd_);
}

void Subscriber::poke() {
  const std::uint64_t one = 1;
  [[maybe_unused]] auto written = write(event_fd_, &one, sizeof one);
}

bool Subscriber::subscribe(const std::string& channel, SteadyClock::time_point until, std::stop_token stop) {
  want(channel);
  std::unique_lock lock(mutex_);
  return confirmed_cv_.wait_until(lock, stop, until, [&] { return confirmed_.count(channel) > 0; });
}

void Subscriber::want(const std::string& channel) {
  std::lock_guard lock(mutex_);
  const auto [it, added] = wanted_.try_emplace(channel);
  ++it->second.users;
  if (added) poke();
}

void Subscriber::unsubscribe(const std::string& channel) {
  std::lock_guard lock(mutex_);
  const auto it = wanted_.find(channel);
  if (it == wanted_.end() || it->second.users == 0) return;
  if (--it->second.users == 0) it->second.idle_since = SteadyClock::now();
}

bool Subscriber::listening(const std::string& channel) {
  std::lock_guard lock(mutex_);
  return confirmed_.count(channel) > 0;
}

void Subscriber::pause(std::chrono::milliseconds how_long) {
  const auto until = SteadyClock::now() + how_long;
  for (auto now = SteadyClock::now(); now < until; now = SteadyClock::now()) {
    pollfd fds[2] = {{stop_fd_, POLLIN, 0}, {event_fd_, POLLIN, 0}};
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - now);
    if (poll(fds, 2, static_cast<int>(left.count())) < 0 && errno != EINTR) return;
    if (fds[0].revents & POLLIN) return;  // the destructor
    // The subscriptions wait for the next connection (serve() sends all it wants then).
    if (fds[1].revents & POLLIN) drain(event_fd_);
    call(events_.on_turn);
  }
}

bool Subscriber::reconnect(Context& context, std::set<std::string>& sent, std::string& out,
                           std::chrono::milliseconds& backoff) {
  try {
    auto settings = settings_;
    if (cluster_nodes_) {
      // Never a server outside the cluster the URL may name (it would hear no wake-up).
      if (auto nodes = cluster_nodes_(); !nodes.empty()) settings.cluster_seeds = std::move(nodes);
    }
    // Bounded like any call, and ended at once by the destructor (stop_fd_).
    context = open_context(settings, Wait(SteadyClock::now() + kReplyTimeout), nullptr, stop_fd_).context;
  } catch (const Error&) {
    pause(backoff);
    backoff = std::min(backoff * 2, kMaxBackoff);
    return false;
  }
  sent.clear();
  out.clear();
  call(events_.on_reset);  // messages may have been missed while we were away
  return true;
}

void Subscriber::serve(Context& context, std::set<std::string>& sent, std::string& out) {
  // Bring the subscriptions in line with what the waiters want; channels idle for a while
  // are dropped.
  int housekeeping_ms = -1;
  {
    std::lock_guard lock(mutex_);
    const auto now = SteadyClock::now();
    for (auto it = wanted_.begin(); it != wanted_.end();) {
      if (it->second.users == 0 && now - it->second.idle_since >= kIdleLinger) {
        it = wanted_.erase(it);
      } else {
        if (it->second.users == 0) housekeeping_ms = static_cast<int>(std::chrono::milliseconds(kIdleLinger).count());
        ++it;
      }
    }
    for (const auto& [channel, want] : wanted_) {
      if (sent.insert(channel).second) {
        append_command(out, {"SUBSCRIBE", channel});
      }
    }
    for (auto it = sent.begin(); it != sent.end();) {
      if (wanted_.count(*it)) {
        ++it;
        continue;
      }
      append_command(out, {"UNSUBSCRIBE", *it});
      confirmed_.erase(*it);
      it = sent.erase(it);
    }
  }
  // The socket is non-blocking: write what it takes now, the rest when poll() says it may.
  if (!write_pending(context.get(), out)) throw BackendUnavailable(context->errstr);
  pollfd fds[3] = {{context->fd, static_cast<short>(POLLIN | (out.empty() ? 0 : POLLOUT)), 0},
                   {event_fd_, POLLIN, 0},
                   {stop_fd_, POLLIN, 0}};
  if (poll(fds, 3, housekeeping_ms) < 0) return;  // EINTR: look again
  if (fds[1].revents & POLLIN) drain(event_fd_);
  if (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) {
    if (!read_available(context.get())) throw BackendUnavailable(context->errstr);
    handle_replies(context);
  }
  call(events_.on_turn);
}

void Subscriber::handle_replies(Context& context) {
  for (;;) {
    Reply reply;
    if (!next_reply(context.get(), reply)) throw BackendUnavailable(context->errstr);
    if (!reply) break;
    // Anything not shaped like a pub/sub message is ignored: a hostile or broken server must
    // not crash us. An error reply (a SUBSCRIBE refused) leaves the waiters to their looks.
    if (reply->type != REDIS_REPLY_ARRAY || reply->elements < 3 || !is_string(reply->element[0])) continue;
    const std::string kind(reply->element[0]->str, reply->element[0]->len);
    const std::string channel =
        is_string(reply->element[1]) ? std::string(reply->element[1]->str, reply->element[1]->len) : "";
    if (kind == "message" && is_string(reply->element[2])) {
      call(events_.on_message, channel, std::string(reply->element[2]->str, reply->element[2]->len));
    } else if (kind == "subscribe") {
      // Before `listening` and `subscribe` say so: once they do, the channel's waiters have been
      // poked (a waiter arming or sleeping after that has nothing missed to look for).
      call(events_.on_confirmed, channel);
      std::lock_guard lock(mutex_);
      confirmed_.insert(channel);
      confirmed_cv_.notify_all();
    }
  }
}

void Subscriber::loop(std::stop_token stop) {
  Context context;
  std::set<std::string> sent;  // SUBSCRIBE sent on the current connection
  std::string out;             // commands not yet written to it
  auto backoff = kFirstBackoff;
  auto connected_at = SteadyClock::now();
  while (!stop.stop_requested()) {
    try {
      if (!context) {
        if (!reconnect(context, sent, out, backoff)) continue;
        connected_at = SteadyClock::now();
      }
      serve(context, sent, out);
    } catch (...) {
      // Nothing leaves this thread. The connection is dropped and made again: at once when it
      // had served a while (Redis' `timeout`, a restart), after a growing pause otherwise.
      context.reset();
      {
        std::lock_guard lock(mutex_);
        confirmed_.clear();
      }
      if (SteadyClock::now() - connected_at >= kMaxBackoff) {
        backoff = kFirstBackoff;
      } else {
        pause(backoff);
        backoff = std::min(backoff * 2, kMaxBackoff);
      }
    }
  }
}

}  // namespace turnstile::detail::redis
