// One subscriber connection per client, multiplexing every channel the client waits on. A
// thread owns the hiredis context: it sleeps in poll() on the socket and on an eventfd that
// asks it to change subscriptions, so nothing polls on a timer. Nothing throws out of the
// thread: a failure drops the connection, which is made again (and waiters are poked).
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "backends/redis/connection.hpp"

namespace turnstile::detail::redis {

class Subscriber {
 public:
  // on_message(channel, payload); on_reset() after a reconnect, when messages may have been
  // missed: every waiter should look again. Both run on the subscriber thread; what they
  // throw is dropped (a waiter's periodic look covers a lost wake-up).
  Subscriber(Settings settings, std::function<void(const std::string&, const std::string&)> on_message,
             std::function<void()> on_reset);
  ~Subscriber();

  // Counts a use of the channel and waits (bounded by `until`, ended by `stop`) for the server
  // to confirm the subscription. Returns false when unconfirmed: callers then rely on their
  // periodic re-check.
  bool subscribe(const std::string& channel, SteadyClock::time_point until, std::stop_token stop = {});
  // Drops a use. The subscription itself stays a while (kIdleLinger), so a name waited on
  // again and again costs no SUBSCRIBE/UNSUBSCRIBE per wait.
  void unsubscribe(const std::string& channel);
  // Whether the server has confirmed the subscription: every message from now on arrives.
  bool listening(const std::string& channel);

 private:
  void loop(std::stop_token stop);
  void poke();
  // Connects and subscribes anew; false (after a pause) when it could not.
  bool reconnect(Context& context, std::set<std::string>& sent, std::string& out, std::chrono::milliseconds& backoff);
  // Sends what the waiters want changed; reads and dispatches what arrived.
  void serve(Context& context, std::set<std::string>& sent, std::string& out);
  // Reads every reply now buffered: messages go to the waiters, SUBSCRIBE confirmations to
  // wait_subscribed.
  void handle_replies(Context& context);
  void pause(std::chrono::milliseconds how_long);

  Settings settings_;
  std::function<void(const std::string&, const std::string&)> on_message_;
  std::function<void()> on_reset_;
  int event_fd_ = -1;  // subscriptions to change
  int stop_fd_ = -1;   // the destructor: ends a connect or a pause at once
  std::mutex mutex_;
  std::condition_variable_any confirmed_cv_;
  struct Want {
    int users = 0;
    SteadyClock::time_point idle_since{};
  };
  std::map<std::string, Want> wanted_;
  std::set<std::string> confirmed_;
  std::jthread thread_;
};

}  // namespace turnstile::detail::redis
