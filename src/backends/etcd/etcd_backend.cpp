// The etcd backend: etcd's concurrency.Mutex layout and algorithm, generalised to every queue
// primitive. A client's session is one etcd lease, kept alive every TTL/3. A contender of
// NAME puts the key NAME/<lease id in hex> (exclusive entries: exactly etcdctl lock's key) or
// NAME/<lease id in hex>_<n> (shared and lease entries) in a Txn guarded by "create revision
// == 0"; the queue is every key directly under NAME/ with exactly that syntax, in
// create-revision order (keys of a name nested below, NAME/x/..., are never counted), the
// create revision is the fencing token, and a waiter watches the one key it depends on (or,
// for Semaphore leases, the deletions under the prefix). So `etcdctl lock NAME` and turnstile
// exclude each other both ways; an entry written by anyone else (etcdctl's empty value) is an
// exclusive one.
//
// Beyond etcd 3.4's Mutex: after every wait the own key is read again (a waiter whose lease
// expired never takes the lock: etcd-io/etcd#11456); exclusive keys are one per (lease, name),
// so threads of one client queue locally first (etcd-io/etcd#11360); a release deletes the key
// only if its create revision is still ours (etcd-io/etcd#22082); a waiter whose session dies
// stops at once with HoldLost (etcd-io/etcd#19597).
//
// Loss: each lease is a ServerLease of the core's LossClock (last confirmed keep-alive's send
// time + granted TTL - TTL/10). Clean-up: a join whose reply was lost may still be applied
// later, so each join Txn also requires that its request's "cancelled" marker does not exist;
// removing an entry of unknown outcome writes that marker and deletes the key (if it holds
// the join's value) in one Txn, so nothing of the join can survive it. Such removals, and
// leaves that fail, are retried by a background thread until done or the lease is gone.
// A release writes a receipt (a key on the lease) with its delete, so a retry whose first
// reply was lost can tell "released by me" from "gone before".
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <condition_variable>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "backends/etcd/connection.hpp"
#include "core/loss_clock.hpp"

namespace turnstile::detail::etcd {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

// Every network call ends within kCallCap and by the caller's deadline, except that a call
// that must reach etcd once to mean anything (a try-once join) gets at least kOneShot, and
// the look after a wait at least kLastLook.
constexpr milliseconds kCallCap{5000};
constexpr milliseconds kOneShot{1000};
constexpr milliseconds kLastLook{250};
// How long a leave or a clean-up is tried in the caller's thread before the background
// thread takes it over.
constexpr milliseconds kLeaveTry{500};
// A release of a hold already reported lost: its caller is not kept waiting on a dead link
// (the core retries it in the background).
constexpr milliseconds kLostReleaseTry{250};
constexpr milliseconds kReleaseTry{2000};
constexpr std::size_t kMaxReceiptsPerTxn = 16;

// Keys of turnstile's own outside every queue prefix: names cannot contain control characters.
const std::string kCounterPrefix = "\x1fturnstile/permits/";
const std::string kCounterWaiterPrefix = "\x1fturnstile/permit-waiters/";
const std::string kCancelPrefix = "\x1fturnstile/cancelled/";  // + <lease hex>_<request>
const std::string kReceiptPrefix = "\x1fturnstile/released/";  // + <lease hex>_<create revision>

std::string lease_hex(std::int64_t lease) {
  char buffer[24];
  std::snprintf(buffer, sizeof buffer, "%" PRIx64, static_cast<std::uint64_t>(lease));
  return buffer;
}

std::string host_name() {
  char buffer[256] = {};
  gethostname(buffer, sizeof buffer - 1);
  return buffer;
}

SteadyClock::time_point call_deadline() { return SteadyClock::now() + kCallCap; }

// A network call's deadline: the caller's, within [now + floor, now + kCallCap].
SteadyClock::time_point bounded(Deadline deadline, milliseconds floor) {
  const auto now = SteadyClock::now();
  if (!deadline) return now + kCallCap;
  return std::min(now + kCallCap, std::max(*deadline, now + floor));
}

bool passed(Deadline deadline) { return deadline && *deadline <= SteadyClock::now(); }

// A name's entries are its keys NAME/<lease hex> (etcdctl lock's) and NAME/<lease hex>_<n>:
// only direct children of NAME/ with exactly this syntax count, so the keys of another name
// (NAME/x/..., or NAME/<hex>/... of a name that itself looks like an entry key) are never
// taken for entries of NAME.
bool is_entry_suffix(std::string_view suffix) {
  const auto underscore = suffix.find('_');
  const auto hex = suffix.substr(0, underscore);
  if (hex.empty() || hex.size() > 16) return false;
  for (char c : hex) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  if (underscore == std::string_view::npos) return true;
  const auto number = suffix.substr(underscore + 1);
  if (number.empty() || number.size() > 20) return false;
  for (char c : number) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

// The entry keys of a range over `prefix`, in the range's order.
std::vector<const mvccpb::KeyValue*> children(const pb::RangeResponse& range, const std::string& prefix) {
  std::vector<const mvccpb::KeyValue*> result;
  result.reserve(range.kvs_size());
  for (const auto& kv : range.kvs()) {
    if (kv.key().size() > prefix.size() && kv.key().compare(0, prefix.size(), prefix) == 0 &&
        is_entry_suffix(std::string_view(kv.key()).substr(prefix.size()))) {
      result.push_back(&kv);
    }
  }
  return result;
}

// One queue entry as stored: "turnstile <kind> <permits> <limit> <pid> <host> <since ms>
// <request>" (the request number makes each join's value unique). Anything else — etcdctl
// lock's empty value — is an exclusive entry of a foreign contender.
struct Entry {
  std::string key;
  std::int64_t create_revision = 0;
  EntryKind kind = EntryKind::exclusive;
  std::int64_t permits = 1;
  std::int64_t limit = 0;
  std::int64_t pid = 0;
  std::string host;
  std::int64_t since_ms = 0;
};

std::int64_t now_ms() {
  return std::chrono::duration_cast<milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string entry_value(EntryKind kind, std::int64_t permits, std::int64_t limit, const std::string& identity,
                        std::uint64_t request) {
  return "turnstile " + std::string(to_string(kind)) + " " + std::to_string(permits) + " " + std::to_string(limit) + " " +
         identity + " " + std::to_string(now_ms()) + " " + std::to_string(request);
}

Entry parse_entry(const mvccpb::KeyValue& kv) {
  Entry entry;
  entry.key = kv.key();
  entry.create_revision = kv.create_revision();
  std::istringstream text(kv.value());
  std::string magic, kind;
  Entry parsed = entry;
  if (text >> magic >> kind >> parsed.permits >> parsed.limit >> parsed.pid >> parsed.host >> parsed.since_ms &&
      magic == "turnstile") {
    if (kind == "shared") parsed.kind = EntryKind::shared;
    else if (kind == "lease") parsed.kind = EntryKind::lease;
    else parsed.kind = EntryKind::exclusive;
    return parsed;
  }
  return entry;
}

QueueMode queue_mode(const Entry& head) { return head.kind == EntryKind::lease ? QueueMode::semaphore : QueueMode::lock; }

// --- request builders ----------------------------------------------------------------------

pb::RangeRequest queue_range(const std::string& prefix, std::int64_t max_create_revision = 0) {
  pb::RangeRequest range;
  range.set_key(prefix);
  range.set_range_end(prefix_end(prefix));
  range.set_sort_order(pb::RangeRequest::ASCEND);
  range.set_sort_target(pb::RangeRequest::CREATE);
  range.set_max_create_revision(max_create_revision);
  return range;
}

pb::RangeRequest key_range(const std::string& key) {
  pb::RangeRequest range;
  range.set_key(key);
  return range;
}

pb::Compare* add_compare(pb::TxnRequest& txn, const std::string& key, pb::Compare::CompareTarget target, std::int64_t value) {
  auto* compare = txn.add_compare();
  compare->set_key(key);
  compare->set_result(pb::Compare::EQUAL);
  compare->set_target(target);
  if (target == pb::Compare::CREATE) compare->set_create_revision(value);
  else if (target == pb::Compare::MOD) compare->set_mod_revision(value);
  else compare->set_version(value);
  return compare;
}

void add_put(google::protobuf::RepeatedPtrField<pb::RequestOp>* ops, const std::string& key, const std::string& value,
             std::int64_t lease) {
  auto* put = ops->Add()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
  put->set_lease(lease);
}

void add_delete(google::protobuf::RepeatedPtrField<pb::RequestOp>* ops, const std::string& key) {
  ops->Add()->mutable_request_delete_range()->set_key(key);
}

void add_range(google::protobuf::RepeatedPtrField<pb::RequestOp>* ops, const pb::RangeRequest& range) {
  *ops->Add()->mutable_request_range() = range;
}

// Deletes `key` only while it is the entry created at `revision`: a late or resent delete
// never removes a newer entry that reuses the key (etcd-io/etcd#22082).
pb::TxnRequest delete_entry_txn(const std::string& key, std::int64_t revision) {
  pb::TxnRequest txn;
  add_compare(txn, key, pb::Compare::CREATE, revision);
  add_delete(txn.mutable_success(), key);
  return txn;
}

std::vector<Entry> entries_of(const pb::RangeResponse& range, const std::string& prefix) {
  std::vector<Entry> entries;
  for (const auto* kv : children(range, prefix)) entries.push_back(parse_entry(*kv));
  return entries;
}

std::vector<QueueEntryView> views_of(const std::vector<Entry>& entries, std::size_t up_to) {
  std::vector<QueueEntryView> views;
  for (std::size_t i = 0; i <= up_to && i < entries.size(); ++i) views.push_back({entries[i].kind, entries[i].permits});
  return views;
}

// --- held keys ---------------------------------------------------------------------------

// Watches the key of every hold on one Watch stream of its own. Keep-alives prove only that
// the lease lives; a key deleted by hand (`etcdctl del`), with its lease (`etcdctl lease
// revoke`), or overwritten by another writer means the hold is gone, and its holder is told at
// once. Two threads: the reader owns the stream and reads it; the worker writes watch requests,
// re-reads keys whose watch etcd cancelled (a compacted start revision) and tells the losses,
// so that no user callback runs while the stream is open (fork handling counts it as a call).
class KeyWatcher {
 public:
  struct Watched {
    std::string key;
    std::int64_t create_revision = 0;
    std::int64_t lease = 0;
    std::shared_ptr<LossSignal> loss;
    // Guarded by the watcher's mutex:
    std::vector<std::string> values;  // the values this client wrote to the key
    std::int64_t from_revision = 0;   // the first revision not yet seen
    std::int64_t watch_id = -1;       // on the current stream, once etcd created the watch
    bool done = false;                // released or lost: no longer watched
    SteadyClock::time_point not_before;  // its first watch request is sent then
  };

  // `lost` runs (on the worker thread) after a hold was told that its key went.
  KeyWatcher(Connection& connection, std::function<void()> lost)
      : connection_(connection), lost_(std::move(lost)),
        reader_([this](std::stop_token stop) { read_loop(stop); }),
        worker_([this](std::stop_token stop) { work_loop(stop); }) {}
  ~KeyWatcher() { stop(); }

  void stop() {
    reader_.request_stop();
    worker_.request_stop();
    if (reader_.joinable()) reader_.join();
    if (worker_.joinable()) worker_.join();
  }

  // From `seen_revision` + 1 on: the key was read as ours at `seen_revision`.
  std::shared_ptr<Watched> watch(std::string key, std::int64_t create_revision, std::int64_t lease, std::string value,
                                 std::int64_t seen_revision, std::shared_ptr<LossSignal> loss) {
    auto watched = std::make_shared<Watched>();
    watched->key = std::move(key);
    watched->create_revision = create_revision;
    watched->lease = lease;
    watched->loss = std::move(loss);
    watched->values.push_back(std::move(value));
    watched->from_revision = std::max(seen_revision, create_revision) + 1;
    watched->not_before = SteadyClock::now() + kFirstWatchDelay;
    bool wake = false;
    {
      std::lock_guard lock(mutex_);
      watched_.insert(watched);
      if (stream_) creates_.push_back(watched);
      // A worker already waiting for an earlier create's time comes to this one by itself:
      // back-to-back short holds cost no wake-up each.
      wake = !stream_ || !worker_timed_;
    }
    if (wake) cv_.notify_all();
    return watched;
  }

  // Before this client writes `value` to the key itself (a downgrade).
  void allow(Watched& watched, std::string value) {
    std::lock_guard lock(mutex_);
    watched.values.push_back(std::move(value));
  }

  // Before this client deletes the key itself (a release).
  void unwatch(const std::shared_ptr<Watched>& watched) {
    {
      std::lock_guard lock(mutex_);
      if (watched->done || !forget_locked(watched)) return;
    }
    cv_.notify_all();  // a cancel to send
  }

 private:
  static constexpr auto kStreamLife = std::chrono::seconds(60);
  // A hold released sooner is never watched (its release still finds a key gone, and reports
  // the loss): short holds cost etcd no watch. Later holds are watched from the revision at
  // which they were read as ours, so what happened meanwhile is still seen.
  static constexpr auto kFirstWatchDelay = milliseconds(20);

  bool allowed(const Watched& watched, const mvccpb::KeyValue& kv) const {
    return kv.create_revision() == watched.create_revision && kv.lease() == watched.lease &&
           std::find(watched.values.begin(), watched.values.end(), kv.value()) != watched.values.end();
  }

  // With the mutex held: no longer watched, its watch cancelled; true when a cancel is queued.
  bool forget_locked(const std::shared_ptr<Watched>& watched) {
    watched->done = true;
    watched_.erase(watched);
    if (watched->watch_id < 0) return false;
    by_id_.erase(watched->watch_id);
    if (!stream_) return false;
    cancels_.push_back(watched->watch_id);
    return true;
  }

  // With the mutex held: the hold is told by the worker.
  void lose_locked(const std::shared_ptr<Watched>& watched, std::string reason) {
    forget_locked(watched);
    losses_.emplace_back(watched, std::move(reason));
    cv_.notify_all();
  }

  void read_loop(std::stop_token stop) {
    while (!stop.stop_requested()) {
      {
        std::unique_lock lock(mutex_);
        if (!cv_.wait(lock, stop, [&] { return !watched_.empty(); })) return;
      }
      const auto opened = SteadyClock::now();
      try {
        const auto status = run_stream(stop);
        // An expired auth token is renewed here, outside the stream's GrpcScope.
        if (!status.ok() && !stop.stop_requested()) {
          connection_.check_retryable(status, "a watch", SteadyClock::now() + milliseconds(2000));
        }
      } catch (...) {
        // Refused, or the client ended at exit: tried again below unless stopped.
      }
      // A stream that ended at once (etcd down or restarting, a fork) is not reopened in a loop.
      if (SteadyClock::now() - opened < std::chrono::seconds(1)) {
        std::unique_lock lock(mutex_);
        cv_.wait_for(lock, stop, milliseconds(100), [] { return false; });
      }
    }
  }

  grpc::Status run_stream(const std::stop_token& stop) {
    grpc::ClientContext context;
    // Bounded, so that no watch depends on one connection forever.
    connection_.prepare(context, SteadyClock::now() + kStreamLife);
    GrpcScope scope(&context);
    std::stop_callback cancel(stop, [&context] { context.TryCancel(); });
    auto stream = connection_.key_watch_stub().Watch(&context);
    {
      // Every key watched again, each from the first revision not seen yet.
      std::lock_guard lock(mutex_);
      stream_ = stream.get();
      in_flight_.clear();
      by_id_.clear();
      cancels_.clear();
      creates_.clear();
      for (const auto& watched : watched_) {
        watched->watch_id = -1;
        creates_.push_back(watched);
      }
    }
    cv_.notify_all();
    pb::WatchResponse response;
    while (stream->Read(&response)) handle(response);
    context.TryCancel();
    {
      std::unique_lock lock(mutex_);
      stream_ = nullptr;
      cv_.wait(lock, [&] { return !writing_; });  // Finish must not overlap a Write
    }
    return stream->Finish();
  }

  void handle(const pb::WatchResponse& response) {
    std::lock_guard lock(mutex_);
    if (response.created()) {
      // etcd answers a stream's create requests in order.
      if (in_flight_.empty()) return;
      auto watched = std::move(in_flight_.front());
      in_flight_.pop_front();
      if (response.canceled()) {
        if (watched->done) return;
        rechecks_.push_back(watched);
      } else if (watched->done) {
        cancels_.push_back(response.watch_id());
      } else {
        watched->watch_id = response.watch_id();
        by_id_[response.watch_id()] = watched;
        return;
      }
      cv_.notify_all();  // work for the worker
      return;
    }
    const auto found = by_id_.find(response.watch_id());
    if (found == by_id_.end()) return;
    const auto watched = found->second;
    for (const auto& event : response.events()) {
      if (event.kv().key() != watched->key) continue;
      watched->from_revision = std::max(watched->from_revision, event.kv().mod_revision() + 1);
      if (event.type() == mvccpb::Event::DELETE) {
        return lose_locked(watched, "its etcd key was deleted (by hand, or with its lease, revoked or expired)");
      }
      if (!allowed(*watched, event.kv())) {
        return lose_locked(watched, "its etcd key was overwritten by another writer");
      }
    }
    if (response.canceled() || response.compact_revision() != 0) {
      // Events may have been compacted away: the key is read again before a new watch.
      by_id_.erase(found);
      watched->watch_id = -1;
      rechecks_.push_back(watched);
      cv_.notify_all();
    }
  }

  void work_loop(std::stop_token stop) {
    std::unique_lock lock(mutex_);
    const auto other_work = [&] { return !losses_.empty() || !rechecks_.empty() || (stream_ && !cancels_.empty()); };
    for (;;) {
      while (!creates_.empty() && creates_.front()->done) creates_.pop_front();
      // Creates are queued in the order of their delays (a new stream queues past ones first).
      const bool create_pending = stream_ && !creates_.empty();
      if (!other_work() && create_pending && creates_.front()->not_before > SteadyClock::now()) {
        worker_timed_ = true;
        cv_.wait_until(lock, stop, creates_.front()->not_before, other_work);
        worker_timed_ = false;
        if (stop.stop_requested()) return;
        continue;
      }
      if (!other_work() && !create_pending) {
        if (!cv_.wait(lock, stop, [&] { return other_work() || (stream_ && !creates_.empty()); })) return;
        continue;
      }
      if (!losses_.empty()) {
        auto [watched, reason] = std::move(losses_.front());
        losses_.pop_front();
        lock.unlock();
        watched->loss->lose(reason);
        lost_();
        lock.lock();
      } else if (stream_ && (!creates_.empty() || !cancels_.empty())) {
        pb::WatchRequest request;
        if (!cancels_.empty()) {
          request.mutable_cancel_request()->set_watch_id(cancels_.front());
          cancels_.pop_front();
        } else {
          auto watched = std::move(creates_.front());
          creates_.pop_front();
          if (watched->done) continue;
          auto* create = request.mutable_create_request();
          create->set_key(watched->key);
          create->set_start_revision(watched->from_revision);
          in_flight_.push_back(std::move(watched));  // before the answer can come
        }
        // The reader's scope covers the stream; a failed write means it is ending, and the next
        // stream watches every key again.
        auto* stream = stream_;
        writing_ = true;
        lock.unlock();
        stream->Write(request);
        lock.lock();
        writing_ = false;
        cv_.notify_all();
      } else {
        auto watched = std::move(rechecks_.front());
        rechecks_.pop_front();
        if (watched->done) continue;
        lock.unlock();
        std::optional<pb::RangeResponse> now;
        try {
          now = connection_.range(key_range(watched->key), SteadyClock::now() + milliseconds(2000));
        } catch (...) {
          // Not read: watched again from where it was; etcd cancels it again if need be.
        }
        lock.lock();
        if (watched->done) continue;
        if (now && (now->kvs_size() == 0 || !allowed(*watched, now->kvs(0)))) {
          lose_locked(watched, now->kvs_size() == 0 ? "its etcd key was deleted (by hand, or with its lease)"
                                                    : "its etcd key was overwritten by another writer");
          continue;
        }
        if (now) watched->from_revision = std::max(watched->from_revision, now->header().revision() + 1);
        if (stream_) creates_.push_back(watched);  // otherwise the next stream watches it
      }
    }
  }

  Connection& connection_;
  std::function<void()> lost_;
  std::mutex mutex_;
  std::condition_variable_any cv_;
  std::set<std::shared_ptr<Watched>> watched_;
  grpc::ClientReaderWriter<pb::WatchRequest, pb::WatchResponse>* stream_ = nullptr;  // the current one
  bool writing_ = false;
  bool worker_timed_ = false;  // the worker waits for the first queued create's time
  std::list<std::shared_ptr<Watched>> creates_;    // to send on the current stream
  std::list<std::shared_ptr<Watched>> in_flight_;  // sent, not yet answered `created`
  std::list<std::int64_t> cancels_;
  std::list<std::shared_ptr<Watched>> rechecks_;
  std::list<std::pair<std::shared_ptr<Watched>, std::string>> losses_;
  std::map<std::int64_t, std::shared_ptr<Watched>> by_id_;
  // Last: they stop first.
  std::jthread reader_;
  std::jthread worker_;
};

// --- sessions and holds --------------------------------------------------------------------

// One etcd lease: the life of every key this client writes while it lasts.
struct Session {
  std::int64_t lease = 0;
  std::string hex;  // the lease id as keys spell it
  // The core's loss rule for this lease; every hold riding on it is attached.
  std::shared_ptr<ServerLease> server_lease;
  // Attached to server_lease like a hold: tells the backend at once when the clock reports the
  // lease lost, so waiters stop and the lease is no longer used or kept alive.
  std::shared_ptr<LossSignal> watcher;
  // Guarded by the backend's mutex:
  milliseconds ttl{0};                 // as granted (and as keep-alive replies repeat it)
  SteadyClock::time_point next_round;  // the keeper's next keep-alive
  bool lost = false;                   // neither used for new entries nor kept alive any more
  bool gone = false;                   // etcd no longer has the lease: its keys are gone
  bool check_now = false;              // the keeper sends a keep-alive at once (a held key went)
  bool revoked_by_client = false;      // by the client's end: its holds were released with it
  std::set<WatchStream*> waits;
};

class EtcdBackend;

// This client's turn for a name's exclusive key (one per lease and name), left on
// destruction unless handed on (to the hold, or to a clean-up still removing the key).
struct LocalTurn {
  EtcdBackend* backend = nullptr;
  std::string name;
  bool held = false;
  ~LocalTurn();
};

class EtcdHold final : public BackendHold {
 public:
  EtcdHold(EtcdBackend& backend, std::shared_ptr<Session> session, std::string name, std::string key,
           std::int64_t revision, bool gated, std::shared_ptr<LossSignal> loss,
           std::shared_ptr<KeyWatcher::Watched> watched)
      : backend_(backend), session_(std::move(session)), name_(std::move(name)), key_(std::move(key)),
        revision_(revision), gated_(gated), loss_(std::move(loss)), watched_(std::move(watched)) {}
  ~EtcdHold() override;

  std::uint64_t fencing_token() const override { return static_cast<std::uint64_t>(revision_); }
  void downgrade() override;
  void release() override;

 private:
  void forget();

  EtcdBackend& backend_;
  std::shared_ptr<Session> session_;
  std::string name_;
  std::string key_;
  std::int64_t revision_;
  bool gated_;  // holds this client's local turn for name_ (exclusive keys)
  std::shared_ptr<LossSignal> loss_;
  std::shared_ptr<KeyWatcher::Watched> watched_;  // the key, watched while held
  bool released_ = false;
};

// --- process exit ----------------------------------------------------------------------------
// libgrpc's own statics (the poll poller's list of pollers, among others) are made when this
// module is loaded, so they are destroyed at exit before a Client made earlier in static
// storage (a global std::optional<Client> emplaced in main): destroying its channels after
// them crashed (PollPoller::Shutdown on a destroyed list). An exit handler, registered after a
// client's first call (so also after the statics gRPC makes lazily), therefore ends every live
// backend while gRPC still works: its threads stopped, its lease revoked (its keys go, which
// releases its holds), later calls refused. Its gRPC objects are then left to the process's end.
class EtcdBackend;
struct LiveBackends {
  std::mutex mutex;
  std::set<EtcdBackend*> backends;
};
LiveBackends& live_backends() {
  static auto* live = new LiveBackends;  // never destroyed: used by exit handlers
  return *live;
}
void end_backends_at_exit();

class EtcdBackend final : public Backend {
 public:
  explicit EtcdBackend(Settings settings)
      : owned_connection_(std::make_unique<Connection>(std::move(settings))), connection_(*owned_connection_),
        identity_(std::to_string(getpid()) + " " + host_name()) {
    // The session's lease now: connecting checks that etcd answers, a client's first entry
    // needs one round trip rather than two, and no acquire depends on a grant's reply.
    session(call_deadline());
    keeper_ = std::jthread([this](std::stop_token stop) { keep_alive_loop(stop); });
    janitor_ = std::jthread([this](std::stop_token stop) { janitor_loop(stop); });
    {
      auto& live = live_backends();
      std::lock_guard lock(live.mutex);
      live.backends.insert(this);
    }
    static std::once_flag registered;
    std::call_once(registered, [] { std::atexit(end_backends_at_exit); });
  }

  ~EtcdBackend() override {
    bool ended = false;
    {
      auto& live = live_backends();
      std::lock_guard lock(live.mutex);
      live.backends.erase(this);
      ended = ended_at_exit_;
    }
    if (!ended) {
      shut_down();
    } else {
      (void)owned_connection_.release();  // gRPC's globals may be gone: see end_backends_at_exit
    }
    // Sessions refer to clock_, which goes before them otherwise.
    {
      std::lock_guard lock(mutex_);
      session_.reset();
    }
    cleanups_.clear();
  }

  // With live_backends()'s mutex held, at exit.
  void end_at_exit() noexcept {
    ended_at_exit_ = true;
    if (getpid() != pid_) return;  // a forked child's copy: no threads here, the parent's lease
    shut_down();
    connection_.close();
    // Threads still waiting (the program's own, not joined before exit) stop with HoldLost
    // rather than retry a closed connection.
    std::lock_guard lock(mutex_);
    if (!session_) return;
    session_->lost = true;
    for (auto* wait : session_->waits) wait->cancel();
  }

  std::unique_ptr<BackendHold> acquire(const QueueRequest& request, Deadline deadline,
                                       std::shared_ptr<LossSignal> loss) override;
  Inspection inspect(const std::string& name) override;
  bool counter_try_set(const std::string& name, std::int64_t permits) override;
  std::int64_t counter_add(const std::string& name, std::int64_t delta) override;
  std::optional<std::int64_t> counter_get(const std::string& name) override;
  std::int64_t counter_drain(const std::string& name) override;
  bool counter_acquire(const std::string& name, std::int64_t permits, Deadline deadline) override;

  Connection& connection() { return connection_; }
  KeyWatcher& key_watcher() { return key_watcher_; }
  const std::string& identity() const { return identity_; }
  void leave_local_turn(const std::string& name);
  bool lease_gone(const Session& session) {
    std::lock_guard lock(mutex_);
    return session.gone;
  }
  bool revoked_by_client(const Session& session) {
    std::lock_guard lock(mutex_);
    return session.revoked_by_client;
  }
  // The session's lease is gone or must be given up: its holds are told (`reason`), its
  // waiters stop, the keeper stops renewing it and, unless etcd said it is gone, it is revoked
  // in the background.
  void lose_session(const std::shared_ptr<Session>& session, const std::string& reason, bool gone);

  // Release receipts whose release has its answer: deleted by later releases.
  std::vector<std::string> receipts_to_delete();
  void receipts_deleted(const std::vector<std::string>& keys);
  void receipt_done(std::string key);

  // Runs a clean-up Txn (a leave, or the removal of an entry whose join's outcome is unknown):
  // once here, within kLeaveTry, then in the background until it succeeds or the session's
  // lease is gone. A `turn` still held is kept until then (the key may still exist).
  void remove(const std::shared_ptr<Session>& session, pb::TxnRequest txn, LocalTurn* turn);
  // The removal of an entry whose join may or may not have been applied: the join's marker
  // written (so a join still in flight fails) and the key deleted if it holds the join's value.
  void remove_unknown_entry(const std::shared_ptr<Session>& session, const std::string& key, const std::string& marker,
                            const std::string& value, LocalTurn* turn);

 private:
  struct Cleanup {
    std::shared_ptr<Session> session;
    std::function<void(SteadyClock::time_point)> attempt;  // throws until done
    std::string turn;                                     // a name's local turn kept until done, or ""
    milliseconds backoff{100};
    SteadyClock::time_point next_try;
  };

  // A place in this client's local line for a name (one exclusive key per lease and name).
  bool enter_local_turn(const std::string& name, Deadline deadline, const std::stop_token& stop);
  std::shared_ptr<Session> session(SteadyClock::time_point deadline);
  void abandon(const std::shared_ptr<Session>& session);
  void keep_alive_loop(std::stop_token stop);
  // Stops the threads and revokes the lease (unless the session is lost, or this process is a
  // forked child: the lease is its parent's).
  void shut_down() noexcept;
  // A held key went: it may have gone with the lease (revoked), which a keep-alive tells now.
  void check_lease_now();
  void schedule(Cleanup cleanup);
  // One try of a clean-up; true when it is done (or moot: the lease is gone).
  bool try_cleanup(Cleanup& cleanup, SteadyClock::time_point deadline) noexcept;
  void janitor_loop(std::stop_token stop);
  // Waits for an event of the watch (or its end, the deadline, or `stop`); false when the
  // session died meanwhile. `changed_already`, when given, is asked once the watch exists:
  // true means what we wait for happened before the watch began, so no wait.
  bool wait_for_change(const std::shared_ptr<Session>& session, const pb::WatchCreateRequest& watch, Deadline deadline,
                       const std::stop_token& stop, const std::function<bool()>& changed_already = {});
  // Joins a line: puts `key` (created at most once, guarded by the request's marker) and reads
  // `prefix`'s entries in the same round trip. Returns the create revision and the range.
  struct Joined {
    std::int64_t created;    // the entry's create revision
    pb::RangeResponse range;  // the line's entries
    std::int64_t revision;   // the store's revision when the entry was seen
  };
  Joined join(const std::shared_ptr<Session>& live, const std::string& key,
                                                  std::uint64_t request, const std::string& value,
                                                  const std::string& prefix, Deadline deadline, LocalTurn* turn);

  std::unique_ptr<Connection> owned_connection_;
  Connection& connection_;
  const pid_t pid_ = getpid();
  bool ended_at_exit_ = false;  // guarded by live_backends()'s mutex
  std::string identity_;  // "<pid> <host>", for inspect
  std::atomic<std::uint64_t> unique_{0};

  std::mutex mutex_;
  std::shared_ptr<Session> session_;
  std::timed_mutex grant_mutex_;  // one lease grant at a time
  std::set<std::string> receipt_garbage_;

  std::condition_variable_any turns_cv_;
  std::map<std::string, std::list<std::uint64_t>> turns_;  // name -> tickets, the front holds
  std::uint64_t next_ticket_ = 0;

  std::condition_variable_any keeper_cv_;

  std::mutex janitor_mutex_;
  std::condition_variable_any janitor_cv_;
  std::list<Cleanup> cleanups_;

  LossClock clock_;  // after what its thread's callbacks touch, so it stops first
  KeyWatcher key_watcher_{connection_, [this] { check_lease_now(); }};
  std::jthread keeper_;
  std::jthread janitor_;
};

LocalTurn::~LocalTurn() {
  if (held) backend->leave_local_turn(name);
}

EtcdHold::~EtcdHold() {
  if (!released_) forget();  // the core releases first; this only guards misuse
}

void EtcdHold::forget() {
  backend_.key_watcher().unwatch(watched_);
  session_->server_lease->detach(loss_.get());
  if (gated_) backend_.leave_local_turn(name_);
  gated_ = false;
}

void EtcdHold::downgrade() {
  const auto value = entry_value(EntryKind::shared, 1, 0, backend_.identity(), 0);
  backend_.key_watcher().allow(*watched_, value);  // our own write is no loss
  pb::TxnRequest txn;
  add_compare(txn, key_, pb::Compare::CREATE, revision_);
  add_put(txn.mutable_success(), key_, value, session_->lease);
  bool present = false;
  try {
    present = backend_.connection().txn(txn, call_deadline(), true).succeeded();
  } catch (const LeaseGone&) {
  }
  if (!present) loss_->lose("its etcd key was gone (the lease expired or the key was deleted)");
}

// The delete carries a receipt (a key on our lease): when a resent release finds the key gone,
// the receipt tells whether an earlier attempt of this release deleted it (released) or it
// was gone before (lost).
void EtcdHold::release() {
  if (released_) return;
  backend_.key_watcher().unwatch(watched_);  // our own delete is no loss
  bool existed = backend_.revoked_by_client(*session_);
  if (!existed && !backend_.lease_gone(*session_)) {
    const auto receipt = kReceiptPrefix + session_->hex + "_" + std::to_string(revision_);
    const auto garbage = backend_.receipts_to_delete();
    pb::TxnRequest txn;
    add_compare(txn, key_, pb::Compare::CREATE, revision_);
    add_delete(txn.mutable_success(), key_);
    add_put(txn.mutable_success(), receipt, "", session_->lease);
    for (const auto& old : garbage) add_delete(txn.mutable_success(), old);
    add_range(txn.mutable_failure(), key_range(receipt));
    try {
      const auto answer = backend_.connection().txn(
          txn, SteadyClock::now() + (loss_->lost() ? kLostReleaseTry : kReleaseTry), true);
      existed = answer.succeeded() || answer.responses(0).response_range().kvs_size() > 0;
      if (answer.succeeded()) backend_.receipts_deleted(garbage);
      if (existed) backend_.receipt_done(receipt);
    } catch (const LeaseGone&) {
      // Not applied, and the key went with the lease.
      backend_.lose_session(session_, "etcd no longer knows the session's lease", true);
    }
  }
  released_ = true;
  forget();
  if (!existed) loss_->lose("its etcd key was gone before the release (the lease expired or the key was deleted)");
}

std::vector<std::string> EtcdBackend::receipts_to_delete() {
  std::lock_guard lock(mutex_);
  std::vector<std::string> keys;
  for (auto it = receipt_garbage_.begin(); it != receipt_garbage_.end() && keys.size() < kMaxReceiptsPerTxn; ++it) {
    keys.push_back(*it);
  }
  return keys;
}

void EtcdBackend::receipts_deleted(const std::vector<std::string>& keys) {
  std::lock_guard lock(mutex_);
  for (const auto& key : keys) receipt_garbage_.erase(key);
}

void EtcdBackend::receipt_done(std::string key) {
  std::lock_guard lock(mutex_);
  receipt_garbage_.insert(std::move(key));
}

bool EtcdBackend::enter_local_turn(const std::string& name, Deadline deadline, const std::stop_token& stop) {
  std::unique_lock lock(mutex_);
  const auto ticket = next_ticket_++;
  turns_[name].push_back(ticket);
  const auto mine = [&] { return turns_[name].front() == ticket; };
  const bool got = deadline ? turns_cv_.wait_until(lock, stop, *deadline, mine) : turns_cv_.wait(lock, stop, mine);
  if (got) return true;
  auto& waiting = turns_[name];
  waiting.remove(ticket);
  if (waiting.empty()) turns_.erase(name);
  turns_cv_.notify_all();
  return false;
}

void EtcdBackend::leave_local_turn(const std::string& name) {
  std::lock_guard lock(mutex_);
  auto it = turns_.find(name);
  if (it == turns_.end()) return;
  it->second.pop_front();
  if (it->second.empty()) turns_.erase(it);
  turns_cv_.notify_all();
}

std::shared_ptr<Session> EtcdBackend::session(SteadyClock::time_point deadline) {
  {
    std::lock_guard lock(mutex_);
    if (session_ && !session_->lost) return session_;
  }
  std::unique_lock grant(grant_mutex_, std::defer_lock);
  if (!grant.try_lock_until(deadline)) throw BackendUnavailable("no etcd lease was granted before the deadline");
  {
    std::lock_guard lock(mutex_);
    if (session_ && !session_->lost) return session_;
  }
  const auto ttl_seconds = std::max<std::int64_t>(1, (connection_.settings().ttl.count() + 999) / 1000);
  const auto sent_at = SteadyClock::now();
  const auto granted = connection_.lease_grant(ttl_seconds, deadline);
  auto fresh = std::make_shared<Session>();
  fresh->lease = granted.id();
  fresh->hex = lease_hex(granted.id());
  // The TTL etcd granted (it raises requests below its minimum), counted from the request.
  fresh->ttl = seconds(std::max<std::int64_t>(1, granted.ttl()));
  fresh->next_round = sent_at + std::max(milliseconds(200), std::chrono::duration_cast<milliseconds>(fresh->ttl / 3));
  fresh->server_lease = clock_.watch(fresh->ttl, sent_at);
  std::weak_ptr<Session> weak = fresh;
  auto tell_backend = std::make_shared<const LossSignal::Callbacks>(LossSignal::Callbacks{[this, weak](const Error&) {
    if (auto lost = weak.lock()) abandon(lost);
  }, {}});
  fresh->watcher = std::make_shared<LossSignal>("etcd lease " + fresh->hex, std::move(tell_backend));
  fresh->server_lease->attach(fresh->watcher);
  {
    std::lock_guard lock(mutex_);
    session_ = fresh;
  }
  keeper_cv_.notify_all();
  return fresh;
}

void EtcdBackend::lose_session(const std::shared_ptr<Session>& session, const std::string& reason, bool gone) {
  if (gone) {
    std::lock_guard lock(mutex_);
    session->gone = true;
  }
  session->server_lease->lose(reason);  // tells every hold (user callbacks: no lock held)
  abandon(session);
}

void EtcdBackend::abandon(const std::shared_ptr<Session>& session) {
  bool revoke = false;
  {
    std::lock_guard lock(mutex_);
    if (session->lost) return;
    session->lost = true;
    revoke = !session->gone;
    // Waiters stop at once (etcd-io/etcd#19597).
    for (auto* wait : session->waits) wait->cancel();
  }
  keeper_cv_.notify_all();
  // Keys that etcd might still keep (its answers were lost; it revives leases after a
  // restart) go now, or as soon as etcd answers.
  if (revoke) {
    const auto lease = session->lease;
    Cleanup cleanup;
    cleanup.session = session;
    cleanup.attempt = [this, lease](SteadyClock::time_point deadline) { connection_.lease_revoke(lease, deadline); };
    schedule(std::move(cleanup));
  }
}

// Every TTL/3, one keep-alive round on a stream of its own (no lock is held during it, and no
// other call waits for it or it for them). Each round etcd answers moves the loss deadline
// (ServerLease, from the round's send time); one that gets no answer within min(TTL/3, 1 s)
// suspends the holds and is tried again 100 ms later. The LossClock reports the loss itself.
void EtcdBackend::keep_alive_loop(std::stop_token stop) {
  std::unique_lock lock(mutex_);
  while (!stop.stop_requested()) {
    const auto current = session_;
    if (!current || current->lost) {
      keeper_cv_.wait(lock, stop, [&] { return session_ && !session_->lost; });
      continue;
    }
    const auto period = std::max(milliseconds(200), std::chrono::duration_cast<milliseconds>(current->ttl / 3));
    const auto patience = std::min(period, milliseconds(1000));
    keeper_cv_.wait_until(lock, stop, current->next_round,
                          [&] { return session_ != current || current->lost || current->check_now; });
    if (stop.stop_requested() || session_ != current || current->lost) continue;
    current->check_now = false;
    lock.unlock();
    const auto sent_at = SteadyClock::now();
    std::optional<std::int64_t> ttl_left;
    try {
      ttl_left = connection_.keep_alive(current->lease, sent_at + patience);
    } catch (const LeaseGone&) {
      ttl_left = 0;
    } catch (const Error&) {
    }
    if (ttl_left && *ttl_left > 0) {
      current->server_lease->set_ttl(seconds(*ttl_left));
      current->server_lease->confirmed(sent_at);
    } else if (ttl_left) {
      lose_session(current, "etcd no longer knows the session's lease (it expired)", true);
    } else {
      current->server_lease->unconfirmed("the lease keep-alive got no answer from etcd; the lease may still be alive");
    }
    lock.lock();
    if (ttl_left && *ttl_left > 0) {
      current->ttl = seconds(*ttl_left);
      current->next_round = sent_at + std::max(milliseconds(200), std::chrono::duration_cast<milliseconds>(current->ttl / 3));
    } else {
      current->next_round = SteadyClock::now() + milliseconds(100);
    }
  }
}

void EtcdBackend::shut_down() noexcept {
  key_watcher_.stop();
  keeper_.request_stop();
  keeper_cv_.notify_all();
  if (keeper_.joinable()) keeper_.join();
  janitor_.request_stop();
  janitor_cv_.notify_all();
  if (janitor_.joinable()) janitor_.join();
  // Every key this client wrote goes with its lease, at once rather than after the TTL.
  std::shared_ptr<Session> last;
  {
    std::lock_guard lock(mutex_);
    last = session_;
    if (last && last->lost) last.reset();
  }
  if (!last || getpid() != pid_) return;
  try {
    connection_.lease_revoke(last->lease, SteadyClock::now() + milliseconds(1000));
  } catch (const LeaseGone&) {
  } catch (...) {
    return;
  }
  std::lock_guard lock(mutex_);
  last->gone = true;
  last->revoked_by_client = true;
}

void end_backends_at_exit() {
  auto& live = live_backends();
  std::lock_guard lock(live.mutex);
  for (auto* backend : live.backends) backend->end_at_exit();
}

void EtcdBackend::check_lease_now() {
  {
    std::lock_guard lock(mutex_);
    if (!session_ || session_->lost) return;
    session_->check_now = true;
  }
  keeper_cv_.notify_all();
}

void EtcdBackend::schedule(Cleanup cleanup) {
  cleanup.next_try = SteadyClock::now();
  {
    std::lock_guard lock(janitor_mutex_);
    cleanups_.push_back(std::move(cleanup));
  }
  janitor_cv_.notify_all();
}

bool EtcdBackend::try_cleanup(Cleanup& cleanup, SteadyClock::time_point deadline) noexcept {
  bool done = lease_gone(*cleanup.session);  // its keys went with the lease
  if (!done) {
    try {
      cleanup.attempt(deadline);
      done = true;
    } catch (const LeaseGone&) {
      lose_session(cleanup.session, "etcd no longer knows the session's lease", true);
      done = true;
    } catch (...) {
      // Not answered (or refused): tried again later.
    }
  }
  if (done && !cleanup.turn.empty()) leave_local_turn(cleanup.turn);
  return done;
}

void EtcdBackend::remove(const std::shared_ptr<Session>& session, pb::TxnRequest txn, LocalTurn* turn) {
  Cleanup cleanup;
  cleanup.session = session;
  cleanup.attempt = [this, txn = std::move(txn)](SteadyClock::time_point deadline) { connection_.txn(txn, deadline, true); };
  if (try_cleanup(cleanup, SteadyClock::now() + kLeaveTry)) return;
  if (turn && turn->held) {
    cleanup.turn = turn->name;
    turn->held = false;
  }
  schedule(std::move(cleanup));
}

void EtcdBackend::remove_unknown_entry(const std::shared_ptr<Session>& session, const std::string& key,
                                       const std::string& marker, const std::string& value, LocalTurn* turn) {
  pb::TxnRequest txn;
  auto* ours = txn.add_compare();
  ours->set_key(key);
  ours->set_result(pb::Compare::EQUAL);
  ours->set_target(pb::Compare::VALUE);
  ours->set_value(value);
  add_delete(txn.mutable_success(), key);
  add_put(txn.mutable_success(), marker, "", session->lease);
  add_put(txn.mutable_failure(), marker, "", session->lease);
  remove(session, std::move(txn), turn);
}

void EtcdBackend::janitor_loop(std::stop_token stop) {
  std::unique_lock lock(janitor_mutex_);
  while (!stop.stop_requested()) {
    if (cleanups_.empty()) {
      janitor_cv_.wait(lock, stop, [&] { return !cleanups_.empty(); });
      continue;
    }
    auto due = cleanups_.front().next_try;
    for (const auto& cleanup : cleanups_) due = std::min(due, cleanup.next_try);
    if (janitor_cv_.wait_until(lock, stop, due, [&] { return false; }); stop.stop_requested()) break;
    std::list<Cleanup> now_due;
    const auto now = SteadyClock::now();
    for (auto it = cleanups_.begin(); it != cleanups_.end();) {
      auto next = std::next(it);
      if (it->next_try <= now) now_due.splice(now_due.end(), cleanups_, it);
      it = next;
    }
    lock.unlock();
    for (auto it = now_due.begin(); it != now_due.end();) {
      if (try_cleanup(*it, SteadyClock::now() + milliseconds(2000))) {
        it = now_due.erase(it);
      } else {
        it->backoff = std::min(it->backoff * 2, milliseconds(2000));
        it->next_try = SteadyClock::now() + it->backoff;
        ++it;
      }
    }
    lock.lock();
    cleanups_.splice(cleanups_.end(), now_due);
  }
}

bool EtcdBackend::wait_for_change(const std::shared_ptr<Session>& session, const pb::WatchCreateRequest& request,
                                  Deadline deadline, const std::stop_token& stop,
                                  const std::function<bool()>& changed_already) {
  const auto started = SteadyClock::now();
  // A bounded watch: a healthy stream is renewed now and then, so no wait depends on one
  // connection forever.
  auto until = started + seconds(30);
  if (deadline) until = std::min(until, *deadline);
  WatchStream watch(connection_, until);
  {
    std::lock_guard lock(mutex_);
    if (session->lost) return false;
    session->waits.insert(&watch);
  }
  struct Registered {
    EtcdBackend& backend;
    Session& session;
    WatchStream& watch;
    ~Registered() {
      std::lock_guard lock(backend.mutex_);
      session.waits.erase(&watch);
    }
  } registered{*this, *session, watch};
  std::stop_callback on_stop(stop, [&watch] { watch.cancel(); });
  watch.start(request);
  bool already = false;
  if (changed_already && !stop.stop_requested()) {
    try {
      already = changed_already();
    } catch (const BackendUnavailable&) {
      // Could not look: the watch tells.
    }
  }
  pb::WatchResponse response;
  const bool changed = already || watch.next(response);
  {
    std::lock_guard lock(mutex_);
    if (session->lost) return false;
  }
  // A stream that ended at once (etcd restarting, a fork): do not spin.
  if (!changed && SteadyClock::now() - started < milliseconds(50) && !passed(deadline) && !stop.stop_requested()) {
    std::this_thread::sleep_for(milliseconds(100));
  }
  return true;
}

EtcdBackend::Joined EtcdBackend::join(const std::shared_ptr<Session>& live, const std::string& key,
                                                             std::uint64_t request, const std::string& value,
                                                             const std::string& prefix, Deadline deadline, LocalTurn* turn) {
  // The marker of this request: written only by a clean-up of it, after which this join
  // can no longer apply (a resend, or the lost original delivered late).
  const auto marker = kCancelPrefix + live->hex + "_" + std::to_string(request);
  pb::TxnRequest txn;
  add_compare(txn, key, pb::Compare::CREATE, 0);
  add_compare(txn, marker, pb::Compare::CREATE, 0);
  add_put(txn.mutable_success(), key, value, live->lease);
  add_range(txn.mutable_success(), queue_range(prefix));
  add_range(txn.mutable_failure(), key_range(key));
  add_range(txn.mutable_failure(), queue_range(prefix));
  pb::TxnResponse joined;
  try {
    joined = connection_.txn(txn, bounded(deadline, kOneShot), true);
  } catch (const LeaseGone&) {
    throw;  // not applied
  } catch (const BackendUnavailable&) {
    // Applied or not, the entry is removed (in the background if need be) before we report.
    remove_unknown_entry(live, key, marker, value, turn);
    throw;
  }
  // Both branches read the queue second (success: put, range; failure: own key, range).
  if (joined.succeeded()) return {joined.header().revision(), joined.responses(1).response_range(), joined.header().revision()};
  // Our own key from an attempt whose answer was lost (the same value), or somebody else's.
  const auto& own = joined.responses(0).response_range();
  if (own.kvs_size() == 0 || own.kvs(0).value() != value) {
    throw BackendUnavailable("the etcd key '" + key + "' exists but is not this client's entry");
  }
  return {own.kvs(0).create_revision(), joined.responses(1).response_range(), joined.header().revision()};
}

std::unique_ptr<BackendHold> EtcdBackend::acquire(const QueueRequest& request, Deadline deadline,
                                                  std::shared_ptr<LossSignal> loss) {
  const bool try_once = deadline && *deadline <= SteadyClock::now();
  // One exclusive key per (lease, name): this client's threads take turns for it.
  const bool gated = request.kind == EntryKind::exclusive;
  if (gated && !enter_local_turn(request.name, deadline, request.stop)) return nullptr;
  LocalTurn turn{this, request.name, gated};

  const auto prefix = request.name + "/";
  std::shared_ptr<Session> live;
  std::string key;
  std::int64_t revision = 0;
  std::string value;
  std::int64_t seen = 0;  // the store's revision at the last read that found our entry
  std::vector<Entry> entries;
  for (int attempt = 0;; ++attempt) {
    live = session(bounded(deadline, kOneShot));
    const auto number = ++unique_;
    key = prefix + live->hex + (gated ? "" : "_" + std::to_string(number));
    value = entry_value(request.kind, request.permits, request.limit, identity_, number);
    try {
      auto joined = join(live, key, number, value, prefix, deadline, &turn);
      revision = joined.created;
      seen = joined.revision;
      entries = entries_of(joined.range, prefix);
      break;
    } catch (const LeaseGone&) {
      // The lease ended unnoticed; the join was not applied. Once more on a new lease.
      lose_session(live, "etcd no longer knows the session's lease", true);
      if (attempt > 0) throw;
    }
  }

  bool left = false;
  const auto leave = [&]() noexcept {
    if (left) return;
    left = true;
    remove(live, delete_entry_txn(key, revision), &turn);
  };
  const auto session_lost = [&] {
    std::lock_guard lock(mutex_);
    return live->lost;
  };
  try {
    for (;;) {
      // The entries up to ours; ours must still be there (etcd-io/etcd#11456).
      std::size_t mine = entries.size();
      for (std::size_t i = 0; i < entries.size(); ++i) {
        if (entries[i].create_revision == revision && entries[i].key == key) mine = i;
      }
      if (mine == entries.size()) {
        lose_session(live, "a queue entry of the session vanished (its lease expired, or the key was deleted)", false);
        throw HoldLost("the queue entry of '" + request.name + "' vanished while waiting (its etcd lease expired)");
      }
      if (mine > 0) check_queue_mode(request, queue_mode(entries[0]), entries[0].limit);
      const auto verdict = evaluate_queue(views_of(entries, mine), mine, request.limit);
      if (verdict.admitted()) break;
      if (try_once || passed(deadline) || request.stop.stop_requested()) {
        leave();
        return nullptr;
      }
      // The watch starts now, not just after our read: a watch from a revision etcd has
      // already passed joins its "unsynced" watchers, caught up only every 100 ms (that was
      // the handoff p99 under contention). What changed between our read and the watch is
      // found by reading the entries ahead of ours once more after the watch exists.
      pb::WatchCreateRequest watch;
      const auto ahead = std::vector<Entry>(entries.begin(), entries.begin() + static_cast<std::ptrdiff_t>(mine));
      const auto changed_meanwhile = [&] {
        const auto now =
            entries_of(connection_.range(queue_range(prefix, revision - 1), bounded(deadline, kLastLook)), prefix);
        if (now.size() != ahead.size()) return true;
        for (std::size_t i = 0; i < now.size(); ++i) {
          if (now[i].key != ahead[i].key || now[i].create_revision != ahead[i].create_revision || now[i].kind != ahead[i].kind) {
            return true;
          }
        }
        return false;
      };
      if (verdict.wait == WaitFor::leave || verdict.wait == WaitFor::exclusive_end) {
        // concurrency.Mutex's wait: the one key ahead of ours.
        watch.set_key(entries[verdict.index].key);
        if (verdict.wait == WaitFor::leave) watch.add_filters(pb::WatchCreateRequest::NOPUT);
      } else {
        // A lease waits for room: any entry leaving may make it.
        watch.set_key(prefix);
        watch.set_range_end(prefix_end(prefix));
        watch.add_filters(pb::WatchCreateRequest::NOPUT);
      }
      if (!wait_for_change(live, watch, deadline, request.stop, changed_meanwhile)) {
        throw HoldLost("the etcd session of this client ended while waiting for '" + request.name + "'");
      }
      // Look again after every wait, the own key first of all; within the caller's deadline.
      for (;;) {
        if (request.stop.stop_requested()) {
          leave();
          return nullptr;
        }
        try {
          const auto now = connection_.range(queue_range(prefix, revision), bounded(deadline, kLastLook));
          seen = now.header().revision();
          entries = entries_of(now, prefix);
          break;
        } catch (const BackendUnavailable&) {
          if (session_lost()) {
            throw HoldLost("the etcd session of this client ended while waiting for '" + request.name + "'");
          }
          if (passed(deadline)) {
            leave();
            throw BackendUnavailable("no etcd answered while '" + request.name +
                                     "' waited, until the deadline; its queue entry is removed in the background");
          }
        }
      }
    }
  } catch (const HoldLost&) {
    throw;  // the session's lease goes (revoked, or expired), and the entry with it
  } catch (...) {
    leave();
    throw;
  }

  // Watched from the read that found it ours: a deletion since then is not missed.
  auto watched = key_watcher_.watch(key, revision, live->lease, value, seen, loss);
  auto hold = std::make_unique<EtcdHold>(*this, live, request.name, key, revision, gated, loss, std::move(watched));
  turn.held = false;  // the hold keeps the local turn until it is released
  live->server_lease->attach(loss);  // a lease lost meanwhile loses the hold at once
  return hold;
}

struct CounterValue {
  std::optional<std::int64_t> value;
  std::int64_t mod_revision = 0;  // 0 while the key does not exist
};

CounterValue counter_value(const pb::RangeResponse& range) {
  CounterValue result;
  if (range.kvs_size() == 0) return result;
  result.mod_revision = range.kvs(0).mod_revision();
  try {
    result.value = std::stoll(range.kvs(0).value());
  } catch (const std::exception&) {
    throw BackendUnavailable("the PermitCounter key '" + range.kvs(0).key() + "' does not hold a number");
  }
  return result;
}

Inspection EtcdBackend::inspect(const std::string& name) {
  const auto prefix = name + "/";
  pb::TxnRequest read;
  add_range(read.mutable_success(), queue_range(prefix));
  add_range(read.mutable_success(), key_range(kCounterPrefix + name));
  add_range(read.mutable_success(), queue_range(kCounterWaiterPrefix + name + "/"));
  const auto answer = connection_.txn(read, call_deadline(), true);
  Inspection result;
  result.name = name;
  const auto entries = entries_of(answer.responses(0).response_range(), prefix);
  if (!entries.empty()) {
    result.mode = to_string(queue_mode(entries[0]));
    if (result.mode == "semaphore") result.limit = entries[0].limit;
  }
  for (std::size_t i = 0; i < entries.size(); ++i) {
    EntryInfo info;
    info.fencing_token = static_cast<std::uint64_t>(entries[i].create_revision);
    info.kind = to_string(entries[i].kind);
    info.permits = entries[i].permits;
    info.pid = entries[i].pid;
    info.host = entries[i].host;
    info.since = std::chrono::system_clock::time_point(milliseconds(entries[i].since_ms));
    info.holding = evaluate_queue(views_of(entries, i), i, entries[0].limit).admitted();
    (info.holding ? result.holders : result.waiters).push_back(info);
  }
  result.permits = counter_value(answer.responses(1).response_range()).value;
  for (const auto* kv : children(answer.responses(2).response_range(), kCounterWaiterPrefix + name + "/")) {
    EntryInfo info;
    info.kind = "permits";
    info.fencing_token = static_cast<std::uint64_t>(kv->create_revision());
    std::istringstream text(kv->value());
    long long since_ms = 0;
    text >> info.permits >> info.pid >> info.host >> since_ms;
    info.since = std::chrono::system_clock::time_point(milliseconds(since_ms));
    result.waiters.push_back(info);
  }
  return result;
}

// --- PermitCounter: one key changed by Txn on its mod revision -------------------------------

bool EtcdBackend::counter_try_set(const std::string& name, std::int64_t permits) {
  const auto key = kCounterPrefix + name;
  pb::TxnRequest txn;
  add_compare(txn, key, pb::Compare::CREATE, 0);
  add_put(txn.mutable_success(), key, std::to_string(permits), 0);
  return connection_.txn(txn, call_deadline(), false).succeeded();
}

std::int64_t EtcdBackend::counter_add(const std::string& name, std::int64_t delta) {
  const auto key = kCounterPrefix + name;
  for (;;) {
    const auto current = counter_value(connection_.range(key_range(key), call_deadline()));
    std::int64_t updated = 0;
    if (__builtin_add_overflow(current.value.value_or(0), delta, &updated) || updated > max_permits ||
        updated < -max_permits) {
      throw InvalidArgument("PermitCounter '" + name + "': adding " + std::to_string(delta) + " to " +
                            std::to_string(current.value.value_or(0)) + " would leave [-" + std::to_string(max_permits) +
                            ", " + std::to_string(max_permits) + "]; nothing changed");
    }
    pb::TxnRequest txn;
    add_compare(txn, key, pb::Compare::MOD, current.mod_revision);
    add_put(txn.mutable_success(), key, std::to_string(updated), 0);
    if (connection_.txn(txn, call_deadline(), false).succeeded()) return updated;
  }
}

std::optional<std::int64_t> EtcdBackend::counter_get(const std::string& name) {
  return counter_value(connection_.range(key_range(kCounterPrefix + name), call_deadline())).value;
}

std::int64_t EtcdBackend::counter_drain(const std::string& name) {
  const auto key = kCounterPrefix + name;
  for (;;) {
    const auto current = counter_value(connection_.range(key_range(key), call_deadline()));
    if (!current.value) return 0;
    pb::TxnRequest txn;
    add_compare(txn, key, pb::Compare::MOD, current.mod_revision);
    add_put(txn.mutable_success(), key, "0", 0);
    if (connection_.txn(txn, call_deadline(), false).succeeded()) return *current.value;
  }
}

// Waiters line up as keys under the waiter prefix (tied to the session, so a dead waiter
// leaves the line); only the first may take permits, and it watches the counter key, the
// others the waiter just ahead.
bool EtcdBackend::counter_acquire(const std::string& name, std::int64_t permits, Deadline deadline) {
  const auto key = kCounterPrefix + name;
  const auto line_prefix = kCounterWaiterPrefix + name + "/";
  std::shared_ptr<Session> live;
  std::string place;  // our waiter key, once in line
  std::int64_t place_revision = 0;
  bool left = false;
  const auto leave_line = [&]() noexcept {
    if (place.empty() || left) return;
    left = true;
    remove(live, delete_entry_txn(place, place_revision), nullptr);
  };
  const std::stop_token no_stop;
  try {
    for (;;) {
      pb::TxnRequest read;  // the counter and the line ahead of us, at one revision
      add_range(read.mutable_success(), key_range(key));
      add_range(read.mutable_success(), queue_range(line_prefix, place_revision));
      const auto state = connection_.txn(read, bounded(deadline, kOneShot), true);
      const auto current = counter_value(state.responses(0).response_range());
      const auto line = children(state.responses(1).response_range(), line_prefix);
      const bool in_line = !place.empty();
      if (in_line) {
        bool present = false;
        for (const auto* kv : line) present = present || kv->key() == place;
        if (!present) throw HoldLost("the PermitCounter waiter of '" + name + "' vanished while waiting (its etcd lease expired)");
      }
      const bool first = in_line ? line.front()->key() == place : line.empty();
      if (first && current.value.value_or(0) >= permits) {
        pb::TxnRequest take;
        add_compare(take, key, pb::Compare::MOD, current.mod_revision);
        if (in_line) {
          add_compare(take, place, pb::Compare::CREATE, place_revision);
        } else {
          // Still nobody in line: no key under the line's prefix was created since our read
          // (keys of nested names' lines, made before it, do not count; an empty range holds).
          auto* empty = take.add_compare();
          empty->set_key(line_prefix);
          empty->set_range_end(prefix_end(line_prefix));
          empty->set_result(pb::Compare::LESS);
          empty->set_target(pb::Compare::CREATE);
          empty->set_create_revision(state.header().revision() + 1);
        }
        add_put(take.mutable_success(), key, std::to_string(*current.value - permits), 0);
        if (in_line) add_delete(take.mutable_success(), place);
        if (connection_.txn(take, call_deadline(), false).succeeded()) return true;
        continue;  // someone changed the counter meanwhile
      }
      if (passed(deadline)) {
        leave_line();
        return false;
      }
      if (!in_line) {
        live = session(bounded(deadline, kOneShot));
        const auto number = ++unique_;
        const auto candidate = line_prefix + live->hex + "_" + std::to_string(number);
        const auto value = std::to_string(permits) + " " + identity_ + " " + std::to_string(now_ms()) + " " +
                           std::to_string(number);
        place_revision = join(live, candidate, number, value, line_prefix, deadline, nullptr).created;
        place = candidate;
        continue;  // look again from our place
      }
      pb::WatchCreateRequest watch;
      watch.set_start_revision(state.header().revision() + 1);
      if (first) {
        watch.set_key(key);  // the counter changing
      } else {
        // The waiter just ahead leaving.
        for (std::size_t i = 1; i < line.size(); ++i) {
          if (line[i]->key() == place) watch.set_key(line[i - 1]->key());
        }
        watch.add_filters(pb::WatchCreateRequest::NOPUT);
      }
      if (!wait_for_change(live, watch, deadline, no_stop)) {
        throw HoldLost("the etcd session of this client ended while waiting for PermitCounter '" + name + "'");
      }
    }
  } catch (const HoldLost&) {
    throw;  // the session's lease goes, and our place with it
  } catch (...) {
    leave_line();
    throw;
  }
}

}  // namespace
}  // namespace turnstile::detail::etcd

extern "C" std::unique_ptr<turnstile::detail::Backend> turnstile_backend_factory_v1(
    const turnstile::detail::BackendUrl& url, const turnstile::ClientOptions& options) {
  using namespace turnstile::detail::etcd;
  return std::make_unique<EtcdBackend>(parse_settings(url, options));
}
