// SPDX-License-Identifier: Apache-2.0
#include "backends/zookeeper/session.hpp"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <map>

#include "backends/zookeeper/connection.hpp"
#include "backends/zookeeper/errors.hpp"
#include "backends/zookeeper/timeouts.hpp"

namespace turnstile::detail::zookeeper {

void Session::confirm(SteadyClock::time_point sent_at) {
  auto current = confirmed_at_.load();
  while (current < sent_at && !confirmed_at_.compare_exchange_weak(current, sent_at)) {
  }
  std::shared_ptr<ServerLease> lease;
  {
    std::lock_guard lock(lease_mutex_);
    if (lease_->lost() && !expired_) {
      // Reported lost (no answer in time), yet the session lives: the server answered on it.
      // The holds told are lost for good; holds made from now on need a lease that is not.
      lease_ = connection_.clock_.watch(lease_->ttl(), sent_at);
      return;
    }
    lease = lease_;
  }
  lease->confirmed(sent_at);  // may resume holds: their callbacks run outside our mutex
}

std::shared_ptr<ServerLease> Session::lease() const {
  std::lock_guard lock(lease_mutex_);
  return lease_;
}

milliseconds Session::short_wait() const {
  return std::clamp(timeout() / 3, kShortWaitMin, kZookeeperTimes.release_try);
}

CallBudget Session::short_budget() const { return Deadline(SteadyClock::now() + short_wait()); }

// One call's completion state, owned jointly by the caller and the call's entry in the registry
// of calls in flight (below), which its completion claims. The C client runs the completion of
// every call it accepted at most once (on the reply, a connection loss or the session's
// expiry), so a caller that gave up at its bound leaves the state to a completion that may come
// much later and write into it: the results of a transaction and its created paths' buffers
// included, which the C client writes only then.
struct CallState {
  Session* session = nullptr;
  SteadyClock::time_point sent_at;  // what its answer confirms
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  int rc = ZOK;
  std::string value;  // create, sync: the path; get: the data
  Stat stat{};
  bool has_stat = false;
  std::vector<std::string> names;
  std::vector<zoo_op_result_t> results;  // multi
  std::vector<std::vector<char>> buffers;
  std::uint64_t pipelined = 0;  // remove_pipelined: its Connection::add_pipelined id
  // arm_data_watch: the wake, and what the node's data must say for the wait to go on.
  std::shared_ptr<WakeSlot> wake{};
  bool (*still_blocks)(const std::string&) = nullptr;
};

namespace {

// Calls in flight, by id: the C client's context is the id, never a pointer. A completion
// claims its state here. zookeeper_close joins the C client's threads and frees the handle
// without completing calls still pending: ~Session drops their states, and a completion that
// never comes leaks nothing (nor could a late one reach freed memory: its id is gone).
class InFlight {
 public:
  void* add(std::shared_ptr<CallState> call) {
    std::lock_guard lock(mutex_);
    const auto id = next_++;
    calls_.emplace(id, std::move(call));
    return reinterpret_cast<void*>(static_cast<std::uintptr_t>(id));
  }
  std::shared_ptr<CallState> claim(const void* context) {
    std::lock_guard lock(mutex_);
    const auto it = calls_.find(static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(context)));
    if (it == calls_.end()) return nullptr;
    auto call = std::move(it->second);
    calls_.erase(it);
    return call;
  }
  void drop(const Session* session) {
    std::lock_guard lock(mutex_);
    std::erase_if(calls_, [&](const auto& entry) { return entry.second->session == session; });
  }

 private:
  std::mutex mutex_;
  std::uint64_t next_ = 1;
  std::map<std::uint64_t, std::shared_ptr<CallState>> calls_;
};

InFlight& in_flight() {
  static auto* registry = new InFlight;  // never destroyed: a completion may run at exit
  return *registry;
}

// Ends a call on the C client's completion thread: `fill` copies the results (ZOK only). Never
// calls the C client or a hold's callback.
template <class Fill>
void complete(const void* data, int rc, Fill fill) {
  const auto claimed = in_flight().claim(data);
  if (!claimed) return;
  CallState& call = *claimed;
  if (server_answered(rc)) call.session->heard_from_server();
  {
    std::lock_guard lock(call.mutex);
    call.rc = rc;
    if (rc == ZOK) fill(call);
    call.done = true;
  }
  call.cv.notify_all();
}

void void_done(int rc, const void* data) {
  complete(data, rc, [](CallState&) {});
}

void string_done(int rc, const char* value, const void* data) {
  complete(data, rc, [&](CallState& call) { call.value = value ? value : ""; });
}

void string_stat_done(int rc, const char* value, const Stat* stat, const void* data) {
  complete(data, rc, [&](CallState& call) {
    call.value = value ? value : "";
    if (stat) call.stat = *stat;
    call.has_stat = stat != nullptr;
  });
}

void stat_done(int rc, const Stat* stat, const void* data) {
  complete(data, rc, [&](CallState& call) {
    if (stat) call.stat = *stat;
    call.has_stat = stat != nullptr;
  });
}

// A node's data as we read it: what a server or peer stores beyond kMaxNodeData reads as
// empty (a foreign node).
std::string node_text(const char* value, int length) {
  if (!value || length <= 0 || static_cast<std::size_t>(length) > kMaxNodeData) return {};
  return {value, static_cast<std::size_t>(length)};
}

void data_done(int rc, const char* value, int length, const Stat* stat, const void* data) {
  complete(data, rc, [&](CallState& call) {
    call.value = node_text(value, length);
    if (stat) call.stat = *stat;
    call.has_stat = stat != nullptr;
  });
}

void strings_done(int rc, const String_vector* strings, const void* data) {
  complete(data, rc, [&](CallState& call) {
    if (!strings) return;
    call.names.reserve(static_cast<std::size_t>(strings->count));
    for (int i = 0; i < strings->count; ++i) call.names.emplace_back(strings->data[i]);
  });
}

}  // namespace

Session::~Session() {
  zookeeper_close(handle_);
  in_flight().drop(this);  // calls the C client will never complete now
}

template <class Start>
int Session::begin(const std::shared_ptr<CallState>& call, Start start) {
  call->session = this;
  call->sent_at = SteadyClock::now();
  void* context = in_flight().add(call);
  const int started = start(context);
  // Refused before the C client registered the completion (bad arguments, a closed or expired
  // handle): ours to drop. Other refusals (out of memory inside the client) may come after it
  // registered it: left to that completion, or to ~Session.
  if (started == ZBADARGUMENTS || started == ZINVALIDSTATE) in_flight().claim(context);
  return started;
}

int Session::finish(const CallBudget& bound, const std::shared_ptr<CallState>& call) {
  // A stop ends the wait as its bound passing would (registered before the lock is taken: it
  // runs at once when the stop was requested already).
  std::stop_callback on_stop(bound.stop(), [&call] {
    std::lock_guard guard(call->mutex);
    call->cv.notify_all();
  });
  std::unique_lock lock(call->mutex);
  while (!call->done) {
    // The C client completes calls on expiry too; a session seen gone is not waited for.
    if (expired_) return ZSESSIONEXPIRED;
    if (bound.passed()) {
      if (!bound.stopped()) silent_ = true;  // a stop says nothing about the link
      return ZOPERATIONTIMEOUT;              // the completion still comes, to a state that is still alive
    }
    auto until = SteadyClock::now() + kExpiryPoll;  // to see the session gone
    if (bound.deadline()) until = std::min(until, *bound.deadline());
    call->cv.wait_until(lock, until);
  }
  const int rc = call->rc;
  lock.unlock();
  // Confirmed on the caller's thread: it may resume holds, whose callbacks must not run on the
  // C client's completion thread.
  if (server_answered(rc)) confirm(call->sent_at);
  return rc;
}

template <class Start>
int Session::run(const CallBudget& bound, const std::shared_ptr<CallState>& call, Start start) {
  const int started = begin(call, start);
  return started == ZOK ? finish(bound, call) : started;
}

int Session::start_create(const Creation& creation, const std::shared_ptr<CallState>& call) {
  return begin(call, [&](void* context) {
    const auto& path = creation.path;
    const auto& data = creation.data;
    const int flags = creation.flags;
    if (creation.want_stat) {
      return zoo_acreate2(handle_, path.c_str(), data.data(), static_cast<int>(data.size()), connection_.acl(), flags,
                          string_stat_done, context);
    }
    return zoo_acreate(handle_, path.c_str(), data.data(), static_cast<int>(data.size()), connection_.acl(), flags,
                       string_done, context);
  });
}

int Session::create(Creation& creation, const CallBudget& bound) {
  auto call = std::make_shared<CallState>();
  const int started = start_create(creation, call);
  const int rc = started == ZOK ? finish(bound, call) : started;
  if (rc == ZOK) {
    creation.created = call->value;
    creation.stat = call->stat;
  }
  return rc;
}

int Session::create_and_list(Creation& creation, const std::string& parent, const CallBudget& bound,
                             std::vector<std::string>* children, int* listed) {
  // Sent back to back on the one socket: the server runs a session's requests in the order they
  // came, so the listing is read after the create was applied, as if it were sent after its
  // reply, and both cost one round trip.
  auto create_call = std::make_shared<CallState>();
  auto list_call = std::make_shared<CallState>();
  int rc = start_create(creation, create_call);
  *listed = rc != ZOK ? rc : begin(list_call, [&](void* context) {
    return zoo_aget_children(handle_, parent.c_str(), 0, strings_done, context);
  });
  if (rc == ZOK) rc = finish(bound, create_call);
  if (rc == ZOK) {
    creation.created = create_call->value;
    creation.stat = create_call->stat;
  }
  // The listing is waited for only after a create that was applied (else it says nothing).
  if (*listed == ZOK) *listed = rc == ZOK ? finish(bound, list_call) : ZOPERATIONTIMEOUT;
  if (*listed == ZOK) *children = std::move(list_call->names);
  return rc;
}

int Session::remove(const std::string& path, const CallBudget& bound, int version) {
  return run(bound, std::make_shared<CallState>(),
             [&](void* context) { return zoo_adelete(handle_, path.c_str(), version, void_done, context); });
}

int Session::get(const std::string& path, bool watch, const CallBudget& bound, std::string* data, Stat* stat) {
  auto call = std::make_shared<CallState>();
  const int rc = run(bound, call,
                     [&](void* context) { return zoo_aget(handle_, path.c_str(), watch ? 1 : 0, data_done, context); });
  if (rc == ZOK) {
    if (data) *data = std::move(call->value);
    if (stat) *stat = call->stat;
  }
  return rc;
}

int Session::exists(const std::string& path, bool watch, const CallBudget& bound, Stat* stat) {
  auto call = std::make_shared<CallState>();
  const int rc = run(bound, call, [&](void* context) {
    return zoo_aexists(handle_, path.c_str(), watch ? 1 : 0, stat_done, context);
  });
  if (rc == ZOK && stat) *stat = call->stat;
  return rc;
}

int Session::set(const std::string& path, const std::string& data, int version, const CallBudget& bound, Stat* stat) {
  auto call = std::make_shared<CallState>();
  const int rc = run(bound, call, [&](void* context) {
    return zoo_aset(handle_, path.c_str(), data.data(), static_cast<int>(data.size()), version, stat_done, context);
  });
  if (rc == ZOK && stat) *stat = call->stat;
  return rc;
}

int Session::children(const std::string& path, bool watch, const CallBudget& bound, std::vector<std::string>* names) {
  auto call = std::make_shared<CallState>();
  const int rc = run(bound, call, [&](void* context) {
    return zoo_aget_children(handle_, path.c_str(), watch ? 1 : 0, strings_done, context);
  });
  if (rc == ZOK) *names = std::move(call->names);
  return rc;
}

int Session::multi(const std::vector<Op>& ops, const CallBudget& bound, std::vector<std::string>* created) {
  auto call = std::make_shared<CallState>();
  // The C client serializes the operations' paths and data at once (they may be the caller's),
  // but writes the results and the created paths only on completion: those live in the state.
  call->results.resize(ops.size());
  call->buffers.resize(ops.size());
  std::vector<zoo_op_t> zoo_ops(ops.size());
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const auto& op = ops[i];
    switch (op.kind) {
      case Op::Kind::create:
        call->buffers[i].assign(op.path.size() + 64, '\0');  // room for the sequence suffix
        zoo_create_op_init(&zoo_ops[i], op.path.c_str(), op.data.data(), static_cast<int>(op.data.size()),
                           connection_.acl(), op.flags, call->buffers[i].data(),
                           static_cast<int>(call->buffers[i].size()));
        break;
      case Op::Kind::remove: zoo_delete_op_init(&zoo_ops[i], op.path.c_str(), op.version); break;
      case Op::Kind::set:
        zoo_set_op_init(&zoo_ops[i], op.path.c_str(), op.data.data(), static_cast<int>(op.data.size()), op.version,
                        nullptr);
        break;
      case Op::Kind::check: zoo_check_op_init(&zoo_ops[i], op.path.c_str(), op.version); break;
    }
  }
  const int rc = run(bound, call, [&](void* context) {
    return zoo_amulti(handle_, static_cast<int>(zoo_ops.size()), zoo_ops.data(), call->results.data(), void_done,
                      context);
  });
  if (rc == ZOK && created) {
    created->clear();
    for (std::size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].kind != Op::Kind::create) continue;
      const auto& buffer = call->buffers[i];
      created->emplace_back(buffer.data(), strnlen(buffer.data(), buffer.size()));
    }
  }
  return rc;
}

int Session::sync(const std::string& path, const CallBudget& bound) {
  return run(bound, std::make_shared<CallState>(),
             [&](void* context) { return zoo_async(handle_, path.c_str(), string_done, context); });
}

int own_children(Session& session, const std::string& parent, const std::string& uuid, const CallBudget& bound,
                 std::vector<std::string>* names) {
  names->clear();
  // sync first: after a reconnect to a lagging ensemble member, a plain read could miss a node
  // the leader made (and the caller would make a second one, or leave it behind).
  int rc = session.sync(parent, bound);
  std::vector<std::string> children;
  if (rc == ZOK) rc = session.children(parent, false, bound, &children);
  if (rc == ZNONODE) return ZOK;
  if (rc != ZOK) return rc;
  for (const auto& child : children) {
    if (child.find(uuid) == std::string::npos) continue;
    // Ours only if this very session owns it (a node of an earlier session is not, CURATOR-604).
    Stat stat{};
    rc = session.exists(parent + "/" + child, false, bound, &stat);
    if (rc == ZOK && stat.ephemeralOwner == session.id()) names->push_back(child);
    else if (rc != ZNONODE) return rc;
  }
  return ZOK;
}

namespace {
void ping_done(int rc, const Stat*, const void* data) {
  // The session is alive: completions never run once ~Session closed the handle.
  if (const auto ping = in_flight().claim(data)) ping->session->ping_answered(rc, ping->sent_at);
}

void held_node_watched(int rc, const Stat*, const void* data) {
  if (const auto call = in_flight().claim(data)) {
    if (server_answered(rc)) call->session->heard_from_server();
    call->session->held_node_answered(call->value, rc);
  }
}
}  // namespace

void Session::watch_held_node(const std::string& path) {
  auto call = std::make_shared<CallState>();
  call->session = this;
  call->value = path;
  void* context = in_flight().add(std::move(call));
  // watch=1: the watcher of the handle, Connection::on_event, hears of the node's next change.
  const int rc = zoo_aexists(handle_, path.c_str(), 1, held_node_watched, context);
  if (rc == ZBADARGUMENTS || rc == ZINVALIDSTATE) in_flight().claim(context);  // see Session::run
  if (rc != ZOK) held_node_answered(path, ZCONNECTIONLOSS);                    // tried again later
}

namespace {
void pipelined_done(int rc, const void* data) {
  if (const auto call = in_flight().claim(data)) {
    if (server_answered(rc)) call->session->heard_from_server();
    call->session->connection().pipelined_answered(call->pipelined, rc);
  }
}
}  // namespace

void Session::remove_pipelined(const std::string& path, std::function<void(int rc)> finish) {
  auto call = std::make_shared<CallState>();
  call->session = this;
  call->pipelined = connection_.add_pipelined(std::move(finish));
  const auto id = call->pipelined;
  void* context = in_flight().add(std::move(call));
  const int rc = zoo_adelete(handle_, path.c_str(), -1, pipelined_done, context);
  if (rc == ZOK) return;
  if (rc == ZBADARGUMENTS || rc == ZINVALIDSTATE) in_flight().claim(context);  // see Session::run
  // Not sent (or its completion comes too: the first answer wins, see pipelined_answered).
  if (auto unsent = connection_.take_pipelined(id)) unsent(rc);
}

void Session::held_node_answered(const std::string& path, int rc) { connection_.held_node_answered(*this, path, rc); }

namespace {
// On the C client's completion thread: only the wake runs here (it posts the next look).
void data_watch_set(int rc, const char* value, int length, const Stat*, const void* data) {
  const auto call = in_flight().claim(data);
  if (!call) return;
  if (server_answered(rc)) call->session->heard_from_server();
  if (rc == ZOK && (!call->still_blocks || call->still_blocks(node_text(value, length)))) {
    call->wake->watch_set = true;  // its event runs the wake
    return;
  }
  call->wake->fire();  // nothing to watch for: the next look tells why
}
}  // namespace

void Session::arm_data_watch(const std::string& path, bool (*still_blocks)(const std::string&),
                             std::shared_ptr<WakeSlot> wake) {
  auto call = std::make_shared<CallState>();
  call->session = this;
  call->sent_at = SteadyClock::now();
  call->wake = wake;
  call->still_blocks = still_blocks;
  void* context = in_flight().add(std::move(call));
  // getData, not exists: a node already gone leaves no watch behind.
  const int rc = zoo_aget(handle_, path.c_str(), 1, data_watch_set, context);
  if (rc == ZOK) return;
  if (rc == ZBADARGUMENTS || rc == ZINVALIDSTATE) in_flight().claim(context);  // see Session::run
  connection_.wake_soon(std::move(wake));  // not sent (the session is gone): never inside arm()
}

bool Session::start_ping() {
  // A few at most: the C client fails them all when it declares the connection lost.
  constexpr int kMaxPingsInFlight = 8;
  if (pings_in_flight_.load() >= kMaxPingsInFlight) return false;
  auto ping = std::make_shared<CallState>();
  ping->session = this;
  ping->sent_at = SteadyClock::now();
  ++pings_in_flight_;
  void* context = in_flight().add(std::move(ping));
  const int rc = zoo_aexists(handle_, "/", 0, ping_done, context);
  if (rc == ZBADARGUMENTS || rc == ZINVALIDSTATE) in_flight().claim(context);  // see Session::run
  if (rc != ZOK) --pings_in_flight_;
  return rc == ZOK;
}

void Session::ping_answered(int rc, SteadyClock::time_point sent_at) {
  // On the C client's completion thread: holds' callbacks (which may call the C client and
  // wait for its completion thread) must not run here. The keeper confirms it.
  if (!server_answered(rc)) ping_failed_ = true;
  if (server_answered(rc)) {
    heard_from_server();
    ping_round_trip_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now() - sent_at).count();
    auto current = ping_confirmed_.load();
    while (current < sent_at && !ping_confirmed_.compare_exchange_weak(current, sent_at)) {
    }
  }
  --pings_in_flight_;
  {
    std::lock_guard lock(connection_.mutex_);
    connection_.session_event_ = true;
  }
  connection_.cv_.notify_all();
}

}  // namespace turnstile::detail::zookeeper
