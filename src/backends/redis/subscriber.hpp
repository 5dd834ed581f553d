// SPDX-License-Identifier: Apache-2.0
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
  // What the subscriber thread calls; each may be empty. What they throw is dropped (a waiter's
  // periodic look covers a lost wake-up).
  struct Events {
    std::function<void(const std::string& channel, const std::string& payload)> on_message;
    // After a reconnect, when messages may have been missed: every waiter should look again.
    std::function<void()> on_reset;
    // The server confirmed a subscription: messages published before it were missed. Called
    // before listening() says so.
    std::function<void(const std::string& channel)> on_confirmed;
    // At each turn of the thread (request_turn() asks for one): work handed to this thread.
    std::function<void()> on_turn;
  };
  // With a cluster, `cluster_nodes()` (when given) names the nodes to listen on at each
  // (re)connect, the best first, in place of the URL's: nodes the slot map knows (any node gets
  // every PUBLISH).
  Subscriber(Settings settings, Events events, std::function<std::vector<SentinelAddress>()> cluster_nodes = {});
  ~Subscriber();

  // Counts a use of the channel and waits (bounded by `until`, ended by `stop`) for the server
  // to confirm the subscription. Returns false when unconfirmed: callers then rely on their
  // periodic re-check.
  bool subscribe(const std::string& channel, SteadyClock::time_point until, std::stop_token stop = {});
  // Counts a use of the channel without waiting: on_confirmed tells when it is confirmed.
  void want(const std::string& channel);
  // The thread takes a turn soon (on_turn), even while it waits to connect again.
  void request_turn() { poke(); }
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
  // Sleeps (between connection attempts) for `how_long`, taking the turns asked for meanwhile.
  void pause(std::chrono::milliseconds how_long);
  // Calls an event, dropping what it throws.
  template <typename Event, typename... Args>
  static void call(const Event& event, const Args&... args) {
    if (!event) return;
    try {
      event(args...);
    } catch (...) {
    }
  }

  Settings settings_;
  Events events_;
  std::function<std::vector<SentinelAddress>()> cluster_nodes_;
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
