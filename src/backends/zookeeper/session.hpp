// SPDX-License-Identifier: Apache-2.0
// One ZooKeeper connection per turnstile client, through the C client's multithreaded API.
//
// A Session is one zhandle_t, i.e. one ZooKeeper session: its ephemeral nodes live exactly as
// long as it. When the server expires it, the Connection opens a new one; holds made on the
// old one are reported lost. Calls use the C client's asynchronous API (it pipelines concurrent
// calls on its one socket) and wait for the completion on the caller's thread, at most until
// the caller's bound: a request already sent when the link goes silent (no reset) is completed
// by the C client only when it declares the connection lost, two thirds of the granted timeout
// later. A call given up at its bound returns ZOPERATIONTIMEOUT (outcome unknown, like a
// connection loss); its completion state is shared with the C client's completion, so a late
// reply writes into memory that is still alive.
#pragma once

#include <zookeeper/zookeeper.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stop_token>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/call_budget.hpp"
#include "core/loss_clock.hpp"

namespace turnstile::detail::zookeeper {

using std::chrono::milliseconds;

// The most node data we read: turnstile's entries carry a short line; larger data (a hostile
// server or peer) reads as empty, i.e. a foreign node.
inline constexpr std::size_t kMaxNodeData = 64 * 1024;

class Connection;
class WakeSlot;
// One call's completion state (session.cpp).
struct CallState;

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(Connection& connection, zhandle_t* handle, std::shared_ptr<ServerLease> lease)
      : connection_(connection), handle_(handle), lease_(std::move(lease)) {}
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  zhandle_t* handle() const { return handle_; }
  Connection& connection() const { return connection_; }
  // The server's id of the session: the ephemeralOwner of the nodes it creates.
  std::int64_t id() const { return zoo_client_id(handle_)->client_id; }
  // The timeout the server granted (known once connected).
  milliseconds timeout() const { return milliseconds(zoo_recv_timeout(handle_)); }
  // The C client's own state too: it fails pending calls before our watcher hears of it.
  bool connected() const { return connected_.load() && zoo_state(handle_) == ZOO_CONNECTED_STATE; }
  bool expired() const { return expired_.load(); }
  // The send time of the latest request the server answered: the server cannot expire the
  // session before that plus the timeout.
  SteadyClock::time_point confirmed_at() const { return confirmed_at_.load(); }
  void confirm(SteadyClock::time_point sent_at);
  // The lease the session's holds ride on (replaced by the keeper when it was reported lost
  // while the session lived on: new holds need a lease that is not lost).
  std::shared_ptr<ServerLease> lease() const;
  // The keeper's ping (a few may be in flight: one left unanswered on a silent link must not
  // stop the next, whose reply after the link heals lets the C client notice a stream that
  // lost replies). Its answer is noted here (the C client's completion thread must not run
  // holds' callbacks) and applied by the keeper.
  bool start_ping();
  void ping_answered(int rc, SteadyClock::time_point sent_at);

  // How long housekeeping calls (release, downgrade, removals, background ones) and the calls of a
  // try-once acquire wait for their reply: a third of the granted timeout, within 0.5-2 s.
  milliseconds short_wait() const;
  // A budget of one short wait from now.
  CallBudget short_budget() const;
  // True while a call of ours was given up unanswered and nothing was answered since: the
  // link is probably silent, so clean-up is left to the background removal rather than waited for.
  bool silent() const { return silent_.load(); }

  // The calls; each returns the C client's code and notes the server's answer. Each waits for
  // its reply until `bound` passes (or its stop is requested) and returns ZOPERATIONTIMEOUT
  // then: the call may still be applied.
  // A node to create, and on ZOK what was made.
  struct Creation {
    std::string path{};  // the node's, or a sequential node's prefix
    std::string data{};
    int flags = 0;           // ZOO_EPHEMERAL_SEQUENTIAL, ZOO_CONTAINER, ...
    bool want_stat = false;  // create2 (ZooKeeper 3.5+; an older server answers ZUNIMPLEMENTED)
    std::string created{};   // the made node's path
    Stat stat{};             // its Stat, with want_stat
  };
  int create(Creation& creation, const CallBudget& bound);
  // A create and, pipelined behind it, the listing of `parent` (unwatched): one round trip. The
  // create's code is returned; `listed` gets the listing's (ZOK: `children` read after the
  // create was applied), which is only waited for when the create was applied.
  int create_and_list(Creation& creation, const std::string& parent, const CallBudget& bound,
                      std::vector<std::string>* children, int* listed);
  int remove(const std::string& path, const CallBudget& bound, int version = -1);
  int get(const std::string& path, bool watch, const CallBudget& bound, std::string* data, Stat* stat = nullptr);
  int exists(const std::string& path, bool watch, const CallBudget& bound, Stat* stat = nullptr);
  int set(const std::string& path, const std::string& data, int version, const CallBudget& bound, Stat* stat = nullptr);
  int children(const std::string& path, bool watch, const CallBudget& bound, std::vector<std::string>* names);
  // One operation of a transaction.
  struct Op {
    enum class Kind { create, remove, set, check } kind;
    std::string path;
    std::string data;  // create, set
    int flags = 0;     // create
    int version = -1;  // remove, set, check (-1: any version; check: the node must exist)
    static Op create(std::string path, std::string data, int flags) {
      return {Kind::create, std::move(path), std::move(data), flags, -1};
    }
    static Op remove(std::string path) { return {Kind::remove, std::move(path), {}, 0, -1}; }
    static Op set(std::string path, std::string data, int version) {
      return {Kind::set, std::move(path), std::move(data), 0, version};
    }
    static Op check(std::string path, int version = -1) { return {Kind::check, std::move(path), {}, 0, version}; }
  };
  // Sends the deletion of `path` without waiting for it: ZooKeeper applies one session's
  // requests in order, so this session's later calls come after it. `finish` gets the C
  // client's code exactly once: on the connection's keeper thread (a hold's callbacks must not
  // run on the C client's completion thread), at once when the C client refused to send it.
  void remove_pipelined(const std::string& path, std::function<void(int rc)> finish);
  // A transaction; `created` receives the paths the creates made, in order.
  int multi(const std::vector<Op>& ops, const CallBudget& bound, std::vector<std::string>* created = nullptr);
  // Brings the server we talk to up to date with the leader for `path` (zoo_async), so the
  // read after it sees every write applied before: the read that decides "did my write
  // happen?" after a lost reply must not come from a lagging ensemble member.
  int sync(const std::string& path, const CallBudget& bound);

  // For the completions (the C client's completion thread): the server answered something.
  void heard_from_server() { silent_ = false; }

  // Sets a watch on a held node (exists, so it is set whether or not the node is there); its
  // answer goes to Connection::held_node_answered. Never waits.
  void watch_held_node(const std::string& path);
  void held_node_answered(const std::string& path, int rc);
  // For an armed wake (QueuePlace::arm; the Connection has its waiter on `path` already): sets
  // a data watch on `path`, and runs `wake` on the answer when there is nothing to watch for
  // (the node is gone, `still_blocks` says its data no longer blocks, the session is gone, the
  // call failed); a set watch's event runs it later. Never waits.
  void arm_data_watch(const std::string& path, bool (*still_blocks)(const std::string&),
                      std::shared_ptr<WakeSlot> wake);

 private:
  friend class Connection;
  Connection& connection_;
  zhandle_t* handle_;
  mutable std::mutex lease_mutex_;
  std::shared_ptr<ServerLease> lease_;
  std::atomic<SteadyClock::time_point> ping_confirmed_{SteadyClock::time_point{}};
  std::atomic<bool> connected_{false};
  std::atomic<bool> expired_{false};
  std::atomic<SteadyClock::time_point> confirmed_at_{SteadyClock::time_point{}};
  std::atomic<int> pings_in_flight_{0};
  // The last answered ping's round trip (ns), and whether a ping failed since the keeper looked:
  // the keeper reports them (the completion thread must not run the event hook).
  std::atomic<std::int64_t> ping_round_trip_ns_{0};
  std::atomic<bool> ping_failed_{false};
  std::atomic<bool> silent_{false};
  // Runs one asynchronous call (see session.cpp): begin sends it, finish waits for its reply.
  template <class Start>
  int run(const CallBudget& bound, const std::shared_ptr<CallState>& call, Start start);
  template <class Start>
  int begin(const std::shared_ptr<CallState>& call, Start start);
  int finish(const CallBudget& bound, const std::shared_ptr<CallState>& call);
  int start_create(const Creation& creation, const std::shared_ptr<CallState>& call);
};

// The children of `parent` whose name carries `uuid` (a Curator protection id) and that
// `session` owns, read after a sync, each call waiting until `bound`. ZOK (none when `parent`
// is gone) or the failing code.
int own_children(Session& session, const std::string& parent, const std::string& uuid, const CallBudget& bound,
                 std::vector<std::string>* names);

}  // namespace turnstile::detail::zookeeper
