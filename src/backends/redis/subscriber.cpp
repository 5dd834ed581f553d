#include "backends/redis/subscriber.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>

namespace turnstile::detail::redis {

namespace {
constexpr auto kIdleLinger = std::chrono::seconds(30);
}

Subscriber::Subscriber(Settings settings, std::function<void(const std::string&, const std::string&)> on_message,
                       std::function<void()> on_reset)
    : settings_(std::move(settings)), on_message_(std::move(on_message)), on_reset_(std::move(on_reset)) {
  event_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (event_fd_ < 0) throw BackendUnavailable("eventfd failed");
  thread_ = std::jthread([this](std::stop_token stop) { loop(stop); });
}

Subscriber::~Subscriber() {
  thread_.request_stop();
  poke();
  if (thread_.joinable()) thread_.join();
  close(event_fd_);
}

void Subscriber::poke() {
  const std::uint64_t one = 1;
  [[maybe_unused]] auto written = write(event_fd_, &one, sizeof one);
}

bool Subscriber::subscribe(const std::string& channel, SteadyClock::time_point until) {
  std::unique_lock lock(mutex_);
  const auto [it, added] = wanted_.try_emplace(channel);
  ++it->second.users;
  if (added) poke();
  return confirmed_cv_.wait_until(lock, until, [&] { return confirmed_.count(channel) > 0; });
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

void Subscriber::loop(std::stop_token stop) {
  Context context;
  std::set<std::string> sent;  // SUBSCRIBE sent on the current connection
  auto backoff = std::chrono::milliseconds(50);
  while (!stop.stop_requested()) {
    if (!context) {
      try {
        context = open_context(settings_, std::chrono::milliseconds(2000), nullptr);
        backoff = std::chrono::milliseconds(50);
        sent.clear();
        if (on_reset_) on_reset_();  // messages may have been missed while we were away
      } catch (const Error&) {
        pollfd pfd{event_fd_, POLLIN, 0};
        poll(&pfd, 1, static_cast<int>(backoff.count()));
        backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
        continue;
      }
    }
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
          if (it->second.users == 0) housekeeping_ms = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(kIdleLinger).count());
          ++it;
        }
      }
      for (const auto& [channel, want] : wanted_) {
        if (sent.insert(channel).second) {
          const char* argv[] = {"SUBSCRIBE", channel.data()};
          const size_t lengths[] = {9, channel.size()};
          redisAppendCommandArgv(context.get(), 2, argv, lengths);
        }
      }
      for (auto it = sent.begin(); it != sent.end();) {
        if (wanted_.count(*it)) {
          ++it;
          continue;
        }
        const char* argv[] = {"UNSUBSCRIBE", it->data()};
        const size_t lengths[] = {11, it->size()};
        redisAppendCommandArgv(context.get(), 2, argv, lengths);
        confirmed_.erase(*it);
        it = sent.erase(it);
      }
    }
    int done = 0;
    while (!done) {
      if (redisBufferWrite(context.get(), &done) != REDIS_OK) break;
    }
    if (context->err) {
      context.reset();
      std::lock_guard lock(mutex_);
      confirmed_.clear();
      continue;
    }
    pollfd fds[2] = {{context->fd, POLLIN, 0}, {event_fd_, POLLIN, 0}};
    if (poll(fds, 2, housekeeping_ms) < 0) continue;
    if (fds[1].revents & POLLIN) {
      std::uint64_t count;
      [[maybe_unused]] auto got = read(event_fd_, &count, sizeof count);
    }
    if (!(fds[0].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    bool broken = redisBufferRead(context.get()) != REDIS_OK;
    while (!broken) {
      void* raw = nullptr;
      if (redisGetReplyFromReader(context.get(), &raw) != REDIS_OK) {
        broken = true;
        break;
      }
      if (!raw) break;
      Reply reply(static_cast<redisReply*>(raw));
      if (reply->type != REDIS_REPLY_ARRAY || reply->elements < 3) continue;
      const std::string kind(reply->element[0]->str, reply->element[0]->len);
      const std::string channel(reply->element[1]->str ? std::string(reply->element[1]->str, reply->element[1]->len) : "");
      if (kind == "message" && reply->element[2]->str) {
        on_message_(channel, std::string(reply->element[2]->str, reply->element[2]->len));
      } else if (kind == "subscribe") {
        std::lock_guard lock(mutex_);
        confirmed_.insert(channel);
        confirmed_cv_.notify_all();
      }
    }
    if (broken) {
      context.reset();
      std::lock_guard lock(mutex_);
      confirmed_.clear();
    }
  }
}

}  // namespace turnstile::detail::redis
