// The etcd backend: storage for the core's queue algorithm on etcd's concurrency.Mutex layout,
// generalised to every queue primitive. A client's lease (ClientLease) is one etcd lease, kept
// alive every TTL/3. A contender of NAME puts the key NAME/<lease id in hex> (exclusive
// entries: exactly etcdctl lock's key) or NAME/<lease id in hex>_<n> (shared and lease
// entries) in a Txn guarded by "create revision == 0"; the queue is every key directly under
// NAME/ with exactly that syntax, in create-revision order (keys of a name nested below,
// NAME/x/..., are never counted), the create revision is the fencing token, and a waiter
// watches the one key it depends on (or, for Semaphore leases, the deletions under the
// prefix). So `etcdctl lock NAME` and turnstile exclude each other both ways; an entry written
// by anyone else (etcdctl's empty value) is an exclusive one.
//
// Beyond etcd 3.4's Mutex: after every wait the own key is read again, and a waiter whose lease
// ended is never admitted on it (etcd-io/etcd#11456, #19597: the core joins again on a new
// lease); exclusive keys are one per (lease, name), so threads of one client queue locally
// first (etcd-io/etcd#11360); a release deletes the key only if its create revision is still
// ours (etcd-io/etcd#22082).
//
// Loss: each lease is a ServerLease of the core's LossClock (last confirmed keep-alive's send
// time + granted TTL - TTL/10). Late copies: every join, take and counter change Txn is guarded
// by its request's marker (request_markers.hpp), which the join puts whatever its outcome and the
// clean-up of a request whose reply was lost puts too: a copy of a join that reaches etcd
// after its sender was answered, held, released or left changes nothing. Leaving with an entry
// of unknown outcome puts that marker and deletes the key (if it holds the join's value) in
// one Txn. Such leaves, and leaves that fail, are retried by a background thread until done
// or the lease is gone. A release writes a receipt (a key on the lease) with its delete, so a
// retry whose first reply was lost can tell "released by me" from "gone before".
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
#include <utility>

#include "backends/etcd/connection.hpp"
#include "backends/etcd/key_watcher.hpp"
#include "backends/etcd/request_markers.hpp"
#include "backends/etcd/timeouts.hpp"
#include "core/deadline_mutex.hpp"
#include "core/loss_clock.hpp"

namespace turnstile::detail::etcd {
namespace {

constexpr std::size_t kMaxReceiptsPerTxn = 16;

// Keys of turnstile's own outside every queue prefix: names cannot contain control characters.
const std::string kCounterPrefix = "\x1fturnstile/permits/";
const std::string kCounterWaiterPrefix = "\x1fturnstile/permit-waiters/";
const std::string kReceiptPrefix = "\x1fturnstile/released/";  // + <lease hex>_<create revision>
// A take's marker holds this once the take applied, kRefused once its leave retired it.
const std::string kTaken = "taken";
const std::string kRefused = "refused";
const std::string kReturned = "returned";  // applied after the acquire reported it not taken: undone
// A counter change's (add, try_set, drain) marker holds this once the change applied.
const std::string kApplied = "applied";
// A counter change whose reply was lost and which was found not applied is tried again, at most
// this many times in all, before the caller hears that etcd did not answer.
constexpr int kCounterChangeTries = 3;

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
// <request>[ <label>]" (the request number makes each join's value unique). Anything else —
// etcdctl lock's empty value — is an exclusive entry of a foreign contender.
struct EntryKey {
  std::string key;
  std::int64_t create_revision = 0;
  EntryKind kind = EntryKind::exclusive;
  std::int64_t permits = 1;
  std::int64_t limit = 0;
  std::int64_t pid = 0;
  std::string host;
  std::int64_t since_ms = 0;
  std::string label;
  bool foreign = true;  // not written by turnstile (etcdctl lock's empty value, or anything else)
};

std::int64_t now_ms() {
  return std::chrono::duration_cast<milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// `identity` is "<pid> <host>", `label_suffix` " <holder label>" or "".
std::string entry_value(EntryKind kind, std::int64_t permits, std::int64_t limit, const std::string& identity,
                        std::uint64_t request, const std::string& label_suffix) {
  return "turnstile " + std::string(to_string(kind)) + " " + std::to_string(permits) + " " + std::to_string(limit) + " " +
         identity + " " + std::to_string(now_ms()) + " " + std::to_string(request) + label_suffix;
}

// The holder label a value ends with, after the space that follows its last number.
std::string label_after(std::istringstream& text) {
  std::string rest;
  std::getline(text, rest);
  return rest.size() > 1 && rest[0] == ' ' ? rest.substr(1) : std::string();
}

EntryKey parse_entry(const mvccpb::KeyValue& kv) {
  EntryKey entry;
  entry.key = kv.key();
  entry.create_revision = kv.create_revision();
  std::istringstream text(kv.value());
  std::string magic, kind;
  std::uint64_t request = 0;
  EntryKey parsed = entry;
  if (text >> magic >> kind >> parsed.permits >> parsed.limit >> parsed.pid >> parsed.host >> parsed.since_ms >> request &&
      magic == "turnstile") {
    parsed.label = label_after(text);
    if (kind == "shared") parsed.kind = EntryKind::shared;
    else if (kind == "lease") parsed.kind = EntryKind::lease;
    else parsed.kind = EntryKind::exclusive;
    parsed.foreign = false;
    return parsed;
  }
  return entry;
}

QueueMode queue_mode(const EntryKey& head) { return head.kind == EntryKind::lease ? QueueMode::semaphore : QueueMode::lock; }

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

// The Txn applies only while `key` holds exactly `value` (never while it does not exist).
void add_value_compare(pb::TxnRequest& txn, const std::string& key, const std::string& value) {
  auto* compare = txn.add_compare();
  compare->set_key(key);
  compare->set_result(pb::Compare::EQUAL);
  compare->set_target(pb::Compare::VALUE);
  compare->set_value(value);
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

std::vector<EntryKey> entries_of(const pb::RangeResponse& range, const std::string& prefix) {
  std::vector<EntryKey> entries;
  for (const auto* kv : children(range, prefix)) entries.push_back(parse_entry(*kv));
  return entries;
}

std::vector<QueueEntryView> views_of(const std::vector<EntryKey>& entries, std::size_t up_to) {
  std::vector<QueueEntryView> views;
  for (std::size_t i = 0; i <= up_to && i < entries.size(); ++i) views.push_back({entries[i].kind, entries[i].permits});
  return views;
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


// --- leases and holds ----------------------------------------------------------------------

// One etcd lease of this client: the life of every key it writes while the lease lasts.
struct ClientLease {
  std::int64_t id = 0;
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
  int unresolved_takes = 0;            // PermitCounter takes whose marker (on it) is still to be read
  // The markers of this lease's joins and takes (thread-safe on its own).
  std::unique_ptr<RequestMarkers> markers;
  std::set<WatchStream*> waits;
  // A key this client wrote on the lease (so it may read it, whatever its etcd role): the
  // keep-alive's term check reads it. Empty until the first entry.
  std::string readable_key;
};

// A keep-alive round every TTL/3, as etcd's own client does.
milliseconds keep_alive_period(milliseconds ttl) {
  return std::max(kKeepAliveShortestPeriod, std::chrono::duration_cast<milliseconds>(ttl / 3));
}

class EtcdBackend;

// This client's turn for a name's exclusive key (one per lease and name), left on
// destruction unless handed on (to the hold, or to a clean-up still removing the key).
struct LocalTurn {
  EtcdBackend* backend = nullptr;
  std::string name;
  bool held = false;
  LocalTurn(EtcdBackend* backend, std::string name, bool held) : backend(backend), name(std::move(name)), held(held) {}
  LocalTurn(const LocalTurn&) = delete;
  LocalTurn& operator=(const LocalTurn&) = delete;
  ~LocalTurn();
};

class EtcdHold final : public BackendHold {
 public:
  EtcdHold(EtcdBackend& backend, std::shared_ptr<ClientLease> lease, std::string name, std::string key,
           std::int64_t revision, bool gated, std::shared_ptr<LossSignal> loss,
           std::shared_ptr<KeyWatcher::Watched> watched)
      : backend_(backend), lease_(std::move(lease)), name_(std::move(name)), key_(std::move(key)),
        revision_(revision), gated_(gated), loss_(std::move(loss)), watched_(std::move(watched)) {}
  ~EtcdHold() override;

  std::uint64_t fencing_token() const override { return static_cast<std::uint64_t>(revision_); }
  void downgrade() override;
  void release() override;

 private:
  // Stops watching the key and the lease for this hold, and gives up the local turn.
  void let_go();

  EtcdBackend& backend_;
  std::shared_ptr<ClientLease> lease_;
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
  explicit EtcdBackend(Settings settings);
  ~EtcdBackend() override;

  // With live_backends()'s mutex held, at exit.
  void end_at_exit() noexcept;

  std::unique_ptr<QueuePlace> join(const QueueRequest& request, bool try_once, Deadline deadline,
                                   Standing& first) override;
  std::unique_ptr<CounterLine> counter_line(const std::string& name, std::int64_t permits,
                                            const std::stop_token& stop) override;
  Inspection inspect(const std::string& name, Deadline deadline) override;
  bool counter_try_set(const std::string& name, std::int64_t permits) override;
  std::int64_t counter_add(const std::string& name, std::int64_t delta) override;
  std::optional<std::int64_t> counter_get(const std::string& name) override;
  std::int64_t counter_drain(const std::string& name) override;

  Connection& connection() { return connection_; }
  KeyWatcher& key_watcher() { return key_watcher_; }
  const std::string& identity() const { return identity_; }
  const std::string& label_suffix() const { return label_suffix_; }
  void leave_local_turn(const std::string& name);
  bool lease_gone(const ClientLease& lease) {
    std::lock_guard lock(mutex_);
    return lease.gone;
  }
  bool lease_lost(const ClientLease& lease) {
    std::lock_guard lock(mutex_);
    return lease.lost;
  }
  bool revoked_by_client(const ClientLease& lease) {
    std::lock_guard lock(mutex_);
    return lease.revoked_by_client;
  }
  // A take's receipt on `lease` is to be read (+1) or was read or given up (-1): the client does
  // not revoke a lease it gave up while one is (the receipt would go with it).
  void count_unresolved_take(ClientLease& lease, int delta) {
    std::lock_guard lock(mutex_);
    lease.unresolved_takes += delta;
  }
  // The lease is gone or must be given up: its holds are told (`reason`), its waiters stop,
  // the keeper stops renewing it and, unless etcd said it is gone, it is revoked in the
  // background.
  void lose_lease(const std::shared_ptr<ClientLease>& lease, const std::string& reason, bool gone);

  // This client's lease for new keys (a new one when the current one is lost).
  std::shared_ptr<ClientLease> client_lease(SteadyClock::time_point deadline, const std::stop_token& stop = {});
  // A number no other request of this client has (it makes keys and values unique).
  std::uint64_t next_request() { return ++unique_; }

  // Release and take receipts whose call has its answer: deleted by later releases and takes.
  std::vector<std::string> receipts_to_delete();
  void receipts_deleted(const std::vector<std::string>& keys);
  void receipt_done(std::string key);

  // An entry put at the back of a line (a queue, or a PermitCounter's waiters).
  struct Joined {
    std::shared_ptr<ClientLease> lease;
    std::string key;
    std::string value;
    std::int64_t created = 0;  // the entry's create revision
    pb::RangeResponse range;   // the line's entries
    std::int64_t revision = 0;  // the store's revision when the entry was seen
  };
  // The key and value of an entry on `lease` for request number `request`.
  using EntryMaker = std::function<std::pair<std::string, std::string>(const ClientLease& lease, std::uint64_t request)>;
  // Puts an entry under `prefix` and reads the line in the same round trip; once more on a new
  // lease when etcd no longer knew the current one. Throws BackendUnavailable with the entry
  // left in the background, holding on to `turn` until it is gone; CallStopped on a `stop`.
  Joined join_line(const std::string& prefix, const EntryMaker& entry, Deadline deadline, LocalTurn* turn,
                   const std::stop_token& stop = {});
  // Runs a clean-up Txn (a leave): once here, within `first_try`, then in the background until
  // it succeeds or the lease is gone. A `turn` still held is kept until then (the key may
  // exist). Returns the first try's answer, or none (not answered in time, or the lease gone).
  // `finished` runs once it is done (or moot: the lease is gone); `later`, when given, is what
  // the background tries instead of the Txn (it throws until done). A `stop` ends the first
  // try (none at all when it came already, or when `first_try` is not positive), in which an
  // endpoint is tried `attempt_cap` before the next.
  std::optional<pb::TxnResponse> run_cleanup(const std::shared_ptr<ClientLease>& lease, pb::TxnRequest txn,
                                             LocalTurn* turn, milliseconds first_try = kLeaveTry,
                                             std::function<void()> finished = {},
                                             std::function<void(SteadyClock::time_point)> later = {},
                                             const std::stop_token& stop = {}, milliseconds attempt_cap = kAttemptCap);
  // Waits for an event of the watch (or its end, the deadline, `stop`, or the lease's loss).
  // `changed_already`, when given, is asked once the watch exists: true means what we wait for
  // happened before the watch began, so no wait.
  void wait_for_change(ClientLease& lease, const pb::WatchCreateRequest& watch, Deadline deadline,
                       const std::stop_token& stop, const std::function<bool()>& changed_already = {});

 private:
  struct Cleanup {
    std::shared_ptr<ClientLease> lease;
    std::function<void(SteadyClock::time_point)> attempt;  // throws until done
    std::string turn;                                     // a name's local turn kept until done, or ""
    std::function<void()> finished;                       // run once done, or empty
    milliseconds pause = kCleanupFirstPause;
    SteadyClock::time_point next_try;
  };

  // A place in this client's local line for a name (one exclusive key per lease and name).
  bool enter_local_turn(const std::string& name, Deadline deadline, const std::stop_token& stop);
  std::shared_ptr<ClientLease> grant_lease(SteadyClock::time_point deadline, const std::stop_token& stop);
  void give_up(const std::shared_ptr<ClientLease>& lease);
  void keep_alive_loop(std::stop_token stop);
  // One keep-alive round: the TTL etcd confirmed, or none (no answer, or the lease is gone).
  std::optional<milliseconds> keep_alive_round(const std::shared_ptr<ClientLease>& lease,
                                               SteadyClock::time_point sent_at, milliseconds patience);
  // Stops the threads and revokes the lease (unless it is lost, or this process is a forked
  // child: the lease is its parent's).
  void shut_down() noexcept;
  // A held key went: it may have gone with the lease (revoked), which a keep-alive tells now.
  void check_lease_now();
  void schedule(Cleanup cleanup);
  // One try of a clean-up; true when it is done (or moot: the lease is gone).
  bool try_cleanup(Cleanup& cleanup, SteadyClock::time_point deadline) noexcept;
  void janitor_loop(std::stop_token stop);
  // Puts `key` (created at most once, guarded by the request's marker) and reads `prefix`'s
  // entries in the same Txn.
  Joined put_entry(const std::shared_ptr<ClientLease>& lease, std::string key, std::uint64_t request, std::string value,
                   const std::string& prefix, Deadline deadline, LocalTurn* turn, const std::stop_token& stop);
  // Leaves with an entry whose join may or may not have been applied: the join's marker
  // written (so a join still in flight fails) and the key deleted if it holds the join's value.
  void leave_unconfirmed(const std::shared_ptr<ClientLease>& lease, const std::string& key, std::uint64_t request,
                         const std::string& value, LocalTurn* turn);
  // The counter key `key` changed at most once: `change` makes the Txn from the value read
  // (none: nothing to change, return `unchanged`); `answer` what the call returns once it
  // applied. Its Txn is guarded by a request marker (see counter_change_applied).
  using CounterChange = std::function<std::optional<pb::TxnRequest>(const CounterValue&)>;
  std::int64_t change_counter(const std::string& key, const CounterChange& change, std::int64_t unchanged,
                              const std::function<std::int64_t(const CounterValue&)>& answer);
  // One guarded try of a counter change: true when applied, false when its compares failed or
  // it was found not applied (and now never will be).
  bool counter_change_applied(pb::TxnRequest txn, SteadyClock::time_point deadline, int& unknown_outcomes);

  std::unique_ptr<Connection> owned_connection_;
  Connection& connection_;
  const pid_t pid_ = getpid();
  bool ended_at_exit_ = false;  // guarded by live_backends()'s mutex
  std::string identity_;  // "<pid> <host>", for inspect
  std::string label_suffix_;  // " <holder label>" at the end of our values, or ""
  std::atomic<std::uint64_t> unique_{0};

  std::mutex mutex_;
  std::shared_ptr<ClientLease> lease_;
  DeadlineMutex grant_mutex_;  // one lease grant at a time
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

EtcdBackend::EtcdBackend(Settings settings)
    : owned_connection_(std::make_unique<Connection>(std::move(settings))), connection_(*owned_connection_),
      identity_(std::to_string(getpid()) + " " + host_name()),
      label_suffix_(connection_.settings().holder_label.empty() ? "" : " " + connection_.settings().holder_label) {
  // The lease now: connecting checks that etcd answers, a client's first entry needs one round
  // trip rather than two, and no acquire depends on a grant's reply.
  client_lease(connection_.connect_by());
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

EtcdBackend::~EtcdBackend() {
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
  // Leases refer to clock_, which goes before them otherwise.
  {
    std::lock_guard lock(mutex_);
    lease_.reset();
  }
  cleanups_.clear();
}

void EtcdBackend::end_at_exit() noexcept {
  ended_at_exit_ = true;
  if (getpid() != pid_) return;  // a forked child's copy: no threads here, the parent's lease
  shut_down();
  connection_.close();
  // Threads still waiting (the program's own, not joined before exit) stop waiting; joining
  // again on a new lease fails on the closed connection.
  std::lock_guard lock(mutex_);
  if (!lease_) return;
  lease_->lost = true;
  for (auto* wait : lease_->waits) wait->cancel();
}

LocalTurn::~LocalTurn() {
  if (held) backend->leave_local_turn(name);
}

EtcdHold::~EtcdHold() {
  if (!released_) let_go();  // the core releases first; this only guards misuse
}

void EtcdHold::let_go() {
  backend_.key_watcher().unwatch(watched_);
  lease_->server_lease->detach(loss_.get());
  if (gated_) backend_.leave_local_turn(name_);
  gated_ = false;
}

void EtcdHold::downgrade() {
  const auto value = entry_value(EntryKind::shared, 1, 0, backend_.identity(), 0, backend_.label_suffix());
  backend_.key_watcher().allow(*watched_, value);  // our own write is no loss
  pb::TxnRequest txn;
  add_compare(txn, key_, pb::Compare::CREATE, revision_);
  add_put(txn.mutable_success(), key_, value, lease_->id);
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
  bool existed = backend_.revoked_by_client(*lease_);
  if (!existed && !backend_.lease_gone(*lease_)) {
    const auto receipt = kReceiptPrefix + lease_->hex + "_" + std::to_string(revision_);
    const auto garbage = backend_.receipts_to_delete();
    pb::TxnRequest txn;
    add_compare(txn, key_, pb::Compare::CREATE, revision_);
    add_delete(txn.mutable_success(), key_);
    add_put(txn.mutable_success(), receipt, "", lease_->id);
    for (const auto& old : garbage) add_delete(txn.mutable_success(), old);
    add_range(txn.mutable_failure(), key_range(receipt));
    try {
      const auto answer = backend_.connection().txn(
          txn, SteadyClock::now() + (loss_->lost_by_now() ? kLostReleaseTry : kReleaseTry), true);
      existed = answer.succeeded() || answer.responses(0).response_range().kvs_size() > 0;
      if (answer.succeeded()) backend_.receipts_deleted(garbage);
      if (existed) backend_.receipt_done(receipt);
    } catch (const LeaseGone&) {
      // Not applied, and the key went with the lease.
      backend_.lose_lease(lease_, "etcd no longer knows the client's lease", true);
    }
  }
  released_ = true;
  let_go();
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

std::shared_ptr<ClientLease> EtcdBackend::client_lease(SteadyClock::time_point deadline, const std::stop_token& stop) {
  {
    std::lock_guard lock(mutex_);
    if (lease_ && !lease_->lost) return lease_;
  }
  std::unique_lock grant(grant_mutex_, std::defer_lock);
  if (!grant.try_lock_until(deadline)) throw BackendUnavailable("no etcd lease was granted before the deadline");
  {
    std::lock_guard lock(mutex_);
    if (lease_ && !lease_->lost) return lease_;
  }
  auto fresh = grant_lease(deadline, stop);
  {
    std::lock_guard lock(mutex_);
    lease_ = fresh;
  }
  keeper_cv_.notify_all();
  return fresh;
}

std::shared_ptr<ClientLease> EtcdBackend::grant_lease(SteadyClock::time_point deadline, const std::stop_token& stop) {
  const auto ttl_seconds = std::max<std::int64_t>(1, (connection_.settings().ttl.count() + 999) / 1000);
  const auto sent_at = SteadyClock::now();
  const auto granted = connection_.lease_grant(ttl_seconds, deadline, stop);
  auto fresh = std::make_shared<ClientLease>();
  fresh->id = granted.id();
  fresh->hex = lease_hex(granted.id());
  fresh->markers = std::make_unique<RequestMarkers>(fresh->id, fresh->hex);
  // The TTL etcd granted (it raises requests below its minimum), counted from the request.
  fresh->ttl = seconds(std::max<std::int64_t>(1, granted.ttl()));
  fresh->next_round = sent_at + keep_alive_period(fresh->ttl);
  fresh->server_lease = clock_.watch(fresh->ttl, sent_at);
  std::weak_ptr<ClientLease> weak = fresh;
  auto tell_backend = std::make_shared<const LossSignal::Callbacks>(LossSignal::Callbacks{[this, weak](const Error&) {
    if (auto lost = weak.lock()) give_up(lost);
  }, {}});
  fresh->watcher = std::make_shared<LossSignal>("etcd lease " + fresh->hex, std::move(tell_backend));
  fresh->server_lease->attach(fresh->watcher);
  return fresh;
}

void EtcdBackend::lose_lease(const std::shared_ptr<ClientLease>& lease, const std::string& reason, bool gone) {
  if (gone) {
    std::lock_guard lock(mutex_);
    lease->gone = true;
  }
  lease->server_lease->lose(reason);  // tells every hold (user callbacks: no lock held)
  give_up(lease);
}

void EtcdBackend::give_up(const std::shared_ptr<ClientLease>& lease) {
  bool revoke = false;
  {
    std::lock_guard lock(mutex_);
    if (lease->lost) return;
    lease->lost = true;
    revoke = !lease->gone;
    // Waiters stop at once (etcd-io/etcd#19597) and join again on a new lease.
    for (auto* wait : lease->waits) wait->cancel();
  }
  keeper_cv_.notify_all();
  // Keys that etcd might still keep (its answers were lost; it revives leases after a
  // restart) go now, or as soon as etcd answers.
  if (revoke) {
    const auto id = lease->id;
    Cleanup cleanup;
    cleanup.lease = lease;
    cleanup.attempt = [this, id, pending = lease.get()](SteadyClock::time_point deadline) {
      {
        std::lock_guard lock(mutex_);
        if (pending->unresolved_takes > 0) throw BackendUnavailable("a take's receipt on the lease is still to be read");
      }
      connection_.lease_revoke(id, deadline);
    };
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
    const auto current = lease_;
    if (!current || current->lost) {
      keeper_cv_.wait(lock, stop, [&] { return lease_ && !lease_->lost; });
      continue;
    }
    const auto patience = std::min(keep_alive_period(current->ttl), kKeepAlivePatience);
    keeper_cv_.wait_until(lock, stop, current->next_round,
                          [&] { return lease_ != current || current->lost || current->check_now; });
    if (stop.stop_requested() || lease_ != current || current->lost) continue;
    current->check_now = false;
    lock.unlock();
    const auto sent_at = SteadyClock::now();
    const auto ttl = keep_alive_round(current, sent_at, patience);
    lock.lock();
    if (ttl) current->ttl = *ttl;
    current->next_round = ttl ? sent_at + keep_alive_period(*ttl) : SteadyClock::now() + kKeepAliveRetryPause;
  }
}

std::optional<milliseconds> EtcdBackend::keep_alive_round(const std::shared_ptr<ClientLease>& lease,
                                                          SteadyClock::time_point sent_at, milliseconds patience) {
  std::optional<etcd::Connection::KeepAliveAnswer> answer;
  try {
    answer = connection_.keep_alive(lease->id, sent_at + patience);
  } catch (const LeaseGone&) {
    answer.emplace();
  } catch (const Error&) {
  }
  if (!answer) {
    lease->server_lease->unconfirmed("the lease keep-alive got no answer from etcd; the lease may still be alive");
    return std::nullopt;
  }
  if (answer->ttl <= 0) {
    lose_lease(lease, "etcd no longer knows the client's lease (it expired)", true);
    return std::nullopt;
  }
  // A leader resumed after a pause answers keep-alives of leases the new leader may already have
  // revoked (etcd 3.4, etcd-io/etcd#15247): two holders at once. Only a linearizable read served
  // in the keep-alive's own term proves that its answerer still led, with a quorum, after it
  // answered; otherwise this round confirms nothing (the next one, 100 ms later, may). The read
  // is of one of our own keys, which any etcd role that lets us lock lets us read. (Before the
  // lease has an entry, nothing rides on it to be protected.)
  std::string readable_key;
  {
    std::lock_guard lock(mutex_);
    readable_key = lease->readable_key;
  }
  if (!readable_key.empty()) {
    std::optional<std::uint64_t> term;
    try {
      term = connection_.linearizable_term(readable_key, sent_at + patience);
    } catch (const Error&) {
    }
    if (!term || *term != answer->raft_term) {
      lease->server_lease->unconfirmed("the etcd server that renewed the lease may no longer lead the cluster");
      return std::nullopt;
    }
  }
  const milliseconds ttl = seconds(answer->ttl);
  lease->server_lease->set_ttl(ttl);
  lease->server_lease->confirmed(sent_at);
  return ttl;
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
  std::shared_ptr<ClientLease> last;
  {
    std::lock_guard lock(mutex_);
    last = lease_;
    if (last && last->lost) last.reset();
  }
  if (!last || getpid() != pid_) return;
  try {
    connection_.lease_revoke(last->id, SteadyClock::now() + kRevokeAtEnd);
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
    if (!lease_ || lease_->lost) return;
    lease_->check_now = true;
  }
  keeper_cv_.notify_all();
}

// --- clean-up ----------------------------------------------------------------------------

void EtcdBackend::schedule(Cleanup cleanup) {
  cleanup.next_try = SteadyClock::now();
  {
    std::lock_guard lock(janitor_mutex_);
    cleanups_.push_back(std::move(cleanup));
  }
  janitor_cv_.notify_all();
}

bool EtcdBackend::try_cleanup(Cleanup& cleanup, SteadyClock::time_point deadline) noexcept {
  bool done = lease_gone(*cleanup.lease);  // its keys went with the lease
  if (!done) {
    try {
      cleanup.attempt(deadline);
      done = true;
    } catch (const LeaseGone&) {
      lose_lease(cleanup.lease, "etcd no longer knows the client's lease", true);
      done = true;
    } catch (...) {
      // Not answered (or refused): tried again later.
    }
  }
  if (done && cleanup.finished) std::exchange(cleanup.finished, {})();
  // The turn guards the one key per (lease, name); a lost lease is never used again, so the
  // next entry (on a new lease) need not wait for this clean-up.
  if ((done || lease_lost(*cleanup.lease)) && !cleanup.turn.empty()) {
    leave_local_turn(cleanup.turn);
    cleanup.turn.clear();
  }
  return done;
}

std::optional<pb::TxnResponse> EtcdBackend::run_cleanup(const std::shared_ptr<ClientLease>& lease, pb::TxnRequest txn,
                                                        LocalTurn* turn, milliseconds first_try,
                                                        std::function<void()> finished,
                                                        std::function<void(SteadyClock::time_point)> later,
                                                        const std::stop_token& stop, milliseconds attempt_cap) {
  auto answer = std::make_shared<std::optional<pb::TxnResponse>>();
  const auto shared_txn = std::make_shared<const pb::TxnRequest>(std::move(txn));
  Cleanup cleanup;
  cleanup.lease = lease;
  cleanup.finished = std::move(finished);
  cleanup.attempt = [this, shared_txn, answer, stop, attempt_cap](SteadyClock::time_point deadline) {
    *answer = connection_.txn(*shared_txn, deadline, true, stop, attempt_cap);
  };
  const bool may_try = first_try > milliseconds::zero() && !stop.stop_requested();
  if (may_try && try_cleanup(cleanup, SteadyClock::now() + first_try)) return *answer;
  if (turn && turn->held && !lease_lost(*lease)) {
    cleanup.turn = turn->name;
    turn->held = false;
  }
  cleanup.attempt = later ? std::move(later) : [this, shared_txn](SteadyClock::time_point deadline) {
    connection_.txn(*shared_txn, deadline, true);
  };
  schedule(std::move(cleanup));  // its later answers are nobody's
  return std::nullopt;
}

void EtcdBackend::leave_unconfirmed(const std::shared_ptr<ClientLease>& lease, const std::string& key,
                                    std::uint64_t request, const std::string& value, LocalTurn* turn) {
  pb::TxnRequest txn;
  add_value_compare(txn, key, value);
  add_delete(txn.mutable_success(), key);
  lease->markers->retire(txn.mutable_success(), request);
  lease->markers->retire(txn.mutable_failure(), request);
  run_cleanup(lease, std::move(txn), turn, kLeaveTry, [lease, request] { lease->markers->resolved(request); });
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
      if (try_cleanup(*it, SteadyClock::now() + kBackgroundTry)) {
        it = now_due.erase(it);
      } else {
        it->pause = std::min(it->pause * 2, kCleanupLastPause);
        it->next_try = SteadyClock::now() + it->pause;
        ++it;
      }
    }
    lock.lock();
    cleanups_.splice(cleanups_.end(), now_due);
  }
}

// --- lines: joining and waiting ----------------------------------------------------------

void EtcdBackend::wait_for_change(ClientLease& lease, const pb::WatchCreateRequest& request, Deadline deadline,
                                  const std::stop_token& stop, const std::function<bool()>& changed_already) {
  const auto started = SteadyClock::now();
  // A bounded watch: a healthy stream is renewed now and then, so no wait depends on one
  // connection forever.
  auto until = started + kWaitWatchLife;
  if (deadline) until = std::min(until, *deadline);
  WatchStream watch(connection_, until);
  {
    std::lock_guard lock(mutex_);
    if (lease.lost) return;
    lease.waits.insert(&watch);
  }
  struct Registered {
    EtcdBackend& backend;
    ClientLease& lease;
    WatchStream& watch;
    ~Registered() {
      std::lock_guard lock(backend.mutex_);
      lease.waits.erase(&watch);
    }
  } registered{*this, lease, watch};
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
  // A stream that ended at once (etcd restarting, a fork): do not spin.
  if (!changed && SteadyClock::now() - started < kWatchEndedAtOnce && !passed(deadline) && !stop.stop_requested() &&
      !lease_lost(lease)) {
    std::this_thread::sleep_for(kWatchRetryPause);
  }
}

EtcdBackend::Joined EtcdBackend::join_line(const std::string& prefix, const EntryMaker& entry, Deadline deadline,
                                           LocalTurn* turn, const std::stop_token& stop) {
  for (int attempt = 0;; ++attempt) {
    auto lease = client_lease(bounded(deadline, kOneShot), stop);
    const auto number = next_request();
    auto [key, value] = entry(*lease, number);
    try {
      return put_entry(lease, std::move(key), number, std::move(value), prefix, deadline, turn, stop);
    } catch (const LeaseGone&) {
      // The lease ended unnoticed; the join was not applied. Once more on a new lease.
      lose_lease(lease, "etcd no longer knows the client's lease", true);
      if (attempt > 0) throw;
    }
  }
}

EtcdBackend::Joined EtcdBackend::put_entry(const std::shared_ptr<ClientLease>& lease, std::string key,
                                           std::uint64_t request, std::string value, const std::string& prefix,
                                           Deadline deadline, LocalTurn* turn, const std::stop_token& stop) {
  // Guarded by the request's marker, which every copy of this Txn that etcd runs puts, in
  // either branch: once we have an answer (or the clean-up is done), a copy still on its way
  // (resent by gRPC to another endpoint, or held up in a paused member) changes nothing, even
  // after the entry was released or left.
  auto& markers = *lease->markers;
  markers.begin(request);
  pb::TxnRequest txn;
  add_compare(txn, key, pb::Compare::CREATE, 0);
  markers.guard(txn, request);
  add_put(txn.mutable_success(), key, value, lease->id);
  add_range(txn.mutable_success(), queue_range(prefix));
  markers.retire(txn.mutable_success(), request);
  const auto floor = markers.add_sweep(txn.mutable_success());
  add_range(txn.mutable_failure(), key_range(key));
  add_range(txn.mutable_failure(), queue_range(prefix));
  markers.retire(txn.mutable_failure(), request);
  pb::TxnResponse answer;
  try {
    answer = connection_.txn(txn, bounded(deadline, kOneShot), true, stop);
  } catch (const LeaseGone&) {
    markers.resolved(request);
    throw;  // not applied
  } catch (const BackendUnavailable&) {
    // Applied or not, the entry leaves (in the background if need be) before we report.
    leave_unconfirmed(lease, key, request, value, turn);
    throw;
  } catch (const Error&) {
    markers.resolved(request);  // refused (AccessDenied): not applied, nor will a copy be
    throw;
  }
  markers.resolved(request);
  {
    std::lock_guard lock(mutex_);
    if (lease->readable_key.empty()) lease->readable_key = key;
  }
  Joined joined{lease, std::move(key), std::move(value), answer.header().revision(), {}, answer.header().revision()};
  // Both branches read the queue second (success: put, range; failure: own key, range).
  joined.range = std::move(*answer.mutable_responses(1)->mutable_response_range());
  if (answer.succeeded()) {
    markers.swept(floor);
    return joined;
  }
  // Our own key from an earlier copy whose answer was lost (the same value), or somebody else's.
  const auto& own = answer.responses(0).response_range();
  if (own.kvs_size() > 0 && own.kvs(0).value() != joined.value) {
    throw BackendUnavailable("the etcd key '" + joined.key + "' exists but is not this client's entry");
  }
  // An earlier copy put our entry and it was deleted since (by hand): join again.
  if (own.kvs_size() == 0) throw QueueEntryGone();
  joined.created = own.kvs(0).create_revision();
  return joined;
}

// --- the queue: our entry from join until it is held or leaves ----------------------------

class EtcdPlace final : public QueuePlace {
 public:
  EtcdPlace(EtcdBackend& backend, const QueueRequest& request, bool exclusive)
      : backend_(backend), name_(request.name), prefix_(request.name + "/"), stop_(request.stop),
        exclusive_(exclusive), turn_(&backend, request.name, exclusive) {}
  ~EtcdPlace() override { leave(); }

  Standing join(const QueueRequest& request, Deadline deadline);
  Standing look(Deadline deadline) override;
  void wait(const Verdict& verdict, Deadline deadline, const std::stop_token& stop) override;
  std::unique_ptr<BackendHold> hold(std::shared_ptr<LossSignal> loss) override;
  void leave() noexcept override;

 private:
  // Where our entry stands in a read of the queue at `revision`; QueueEntryGone when not there.
  Standing stand(const pb::RangeResponse& range, std::int64_t revision);
  Standing standing() const;
  // After the watch began: whether the entries ahead of ours changed since the last read.
  bool changed_meanwhile(Deadline deadline) const;

  EtcdBackend& backend_;
  const std::string name_;
  const std::string prefix_;
  const std::stop_token stop_;
  const bool exclusive_;  // one key per (lease, name): this client's threads take turns for it
  LocalTurn turn_;
  std::shared_ptr<ClientLease> lease_;
  std::string key_;
  std::string value_;
  std::int64_t revision_ = 0;  // our key's create revision, once joined
  std::int64_t seen_ = 0;      // the store's revision at the last read that found our key
  std::vector<EntryKey> entries_;  // the entries up to ours, as last read
  bool done_ = false;              // left, or handed to a hold
};

Standing EtcdPlace::join(const QueueRequest& request, Deadline deadline) {
  auto joined = backend_.join_line(
      prefix_,
      [&](const ClientLease& lease, std::uint64_t number) {
        return std::pair{prefix_ + lease.hex + (exclusive_ ? "" : "_" + std::to_string(number)),
                         entry_value(request.kind, request.permits, request.limit, backend_.identity(), number,
                                     backend_.label_suffix())};
      },
      deadline, &turn_, request.stop);
  lease_ = std::move(joined.lease);
  key_ = std::move(joined.key);
  value_ = std::move(joined.value);
  revision_ = joined.created;
  return stand(joined.range, joined.revision);
}

Standing EtcdPlace::stand(const pb::RangeResponse& range, std::int64_t revision) {
  auto entries = entries_of(range, prefix_);
  const auto mine = std::find_if(entries.begin(), entries.end(),
                                 [&](const EntryKey& entry) { return entry.create_revision == revision_ && entry.key == key_; });
  if (mine == entries.end()) throw QueueEntryGone();
  entries.erase(mine + 1, entries.end());
  entries_ = std::move(entries);
  seen_ = revision;
  return standing();
}

Standing EtcdPlace::standing() const {
  Standing standing;
  standing.entries = views_of(entries_, entries_.size() - 1);
  if (entries_.size() > 1) {
    standing.mode = queue_mode(entries_.front());
    standing.limit = entries_.front().limit;
  }
  return standing;
}

// The own key is read after every wait, within the caller's deadline; an untimed waiter rides
// out an outage.
Standing EtcdPlace::look(Deadline deadline) {
  // A lease given up goes with its keys: never admitted on it (etcd-io/etcd#11456).
  const auto check_lease = [&] {
    if (backend_.lease_lost(*lease_)) throw QueueEntryGone();
  };
  for (;;) {
    check_lease();
    std::optional<pb::RangeResponse> read;
    try {
      read = backend_.connection().range(queue_range(prefix_, revision_), bounded(deadline, kLastLook));
    } catch (const BackendUnavailable&) {
    }
    check_lease();
    if (read) return stand(*read, read->header().revision());
    // Stopped: the last read, which did not admit us (we waited after it), so the core leaves.
    if (stop_.stop_requested()) return standing();
    if (passed(deadline)) {
      throw BackendUnavailable("no etcd answered while '" + name_ +
                               "' waited, until the deadline; its queue entry is removed in the background");
    }
  }
}

void EtcdPlace::wait(const Verdict& verdict, Deadline deadline, const std::stop_token& stop) {
  pb::WatchCreateRequest watch;
  if (verdict.wait == WaitFor::leave || verdict.wait == WaitFor::exclusive_end) {
    // concurrency.Mutex's wait: the one key ahead of ours.
    watch.set_key(entries_[verdict.index].key);
    if (verdict.wait == WaitFor::leave) watch.add_filters(pb::WatchCreateRequest::NOPUT);
  } else {
    // A lease waits for room: any entry leaving may make it.
    watch.set_key(prefix_);
    watch.set_range_end(prefix_end(prefix_));
    watch.add_filters(pb::WatchCreateRequest::NOPUT);
  }
  // The watch starts now, not just after our read: a watch from a revision etcd has already
  // passed joins its "unsynced" watchers, caught up only every 100 ms (that was the handoff p99
  // under contention). What changed between our read and the watch is found by reading the
  // entries ahead of ours once more after the watch exists.
  backend_.wait_for_change(*lease_, watch, deadline, stop, [&] { return changed_meanwhile(deadline); });
}

bool EtcdPlace::changed_meanwhile(Deadline deadline) const {
  const auto now =
      entries_of(backend_.connection().range(queue_range(prefix_, revision_ - 1), bounded(deadline, kLastLook)), prefix_);
  if (now.size() + 1 != entries_.size()) return true;
  for (std::size_t i = 0; i < now.size(); ++i) {
    if (now[i].key != entries_[i].key || now[i].create_revision != entries_[i].create_revision ||
        now[i].kind != entries_[i].kind) {
      return true;
    }
  }
  return false;
}

std::unique_ptr<BackendHold> EtcdPlace::hold(std::shared_ptr<LossSignal> loss) {
  // Watched from the read that found it ours: a deletion since then is not missed.
  auto watched = backend_.key_watcher().watch(key_, revision_, lease_->id, value_, seen_, loss);
  auto hold = std::make_unique<EtcdHold>(backend_, lease_, name_, key_, revision_, turn_.held, loss, std::move(watched));
  turn_.held = false;  // the hold keeps the local turn until it is released
  done_ = true;
  lease_->server_lease->attach(loss);  // a lease lost meanwhile loses the hold at once
  return hold;
}

void EtcdPlace::leave() noexcept {
  if (done_ || revision_ == 0) return;  // not joined: a join of unknown outcome left by itself
  done_ = true;
  backend_.run_cleanup(lease_, delete_entry_txn(key_, revision_), &turn_);
}

std::unique_ptr<QueuePlace> EtcdBackend::join(const QueueRequest& request, bool, Deadline deadline, Standing& first) {
  const bool exclusive = request.kind == EntryKind::exclusive;
  if (exclusive && !enter_local_turn(request.name, deadline, request.stop)) return nullptr;
  auto place = std::make_unique<EtcdPlace>(*this, request, exclusive);
  try {
    first = place->join(request, deadline);
  } catch (const CallStopped&) {
    // Stopped while joining (a join that may have been applied leaves in the background): not
    // admitted, as a stop while waiting would end it.
    return nullptr;
  }
  return place;
}

// --- PermitCounter: one key changed by Txn on its mod revision ---------------------------
// Waiters line up as keys under the waiter prefix (on the lease, so a dead waiter leaves the
// line); only the first may take permits, and it watches the counter key, the others the
// waiter just ahead. A take is guarded by its request's marker (request_markers.hpp) and puts
// it, reading "taken": when its reply is lost, leave() reads the marker and, if the take was
// not applied, retires it in the same Txn, so the take cannot apply later (a stalled request
// delivered late) and the acquire knows for sure whether it took the permits. Every call ends
// on the caller's stop and by its deadline: a take whose outcome a stopped or timed caller
// cannot wait for is settled in the background (a take found applied is given back), and the
// acquire reports false; only an untimed caller without a stop waits up to kTakeOutcomeTry.

class EtcdCounterLine final : public CounterLine {
 public:
  EtcdCounterLine(EtcdBackend& backend, const std::string& name, std::int64_t permits, const std::stop_token& stop)
      : backend_(backend), counter_key_(kCounterPrefix + name), line_prefix_(kCounterWaiterPrefix + name + "/"),
        permits_(permits), stop_(stop) {}
  ~EtcdCounterLine() override {
    if (take_lease_) resolved();  // the core leaves first; this only guards misuse
  }

  CounterStanding look(bool last_try, Deadline deadline) override;
  bool take(const CounterStanding& seen, Deadline deadline) override;
  void join(Deadline deadline) override;
  void wait(CounterWait wait, Deadline deadline, const std::stop_token& stop) override;
  bool leave() noexcept override;

 private:
  enum class TakeOutcome { taken, not_taken, unknown };
  bool take_reply_lost(Deadline deadline);
  // A take whose reply was lost: tells it by its marker until `until` (or the stop), then
  // leaves it to the background, which gives back a take it finds applied.
  TakeOutcome settle_take(SteadyClock::time_point until, const std::stop_token& stop,
                          milliseconds attempt_cap = kAttemptCap);
  // The take's outcome is known (or no longer matters): its marker is nobody's concern now.
  void resolved();
  // What the background tries for a take that leave() could not settle in time.
  std::function<void(SteadyClock::time_point)> undo_take(const std::shared_ptr<ClientLease>& lease,
                                                         std::uint64_t request, pb::TxnRequest settle) const;

  EtcdBackend& backend_;
  const std::string counter_key_;
  const std::string line_prefix_;
  const std::int64_t permits_;
  const std::stop_token stop_;
  std::shared_ptr<ClientLease> lease_;
  std::string place_;  // our waiter key, once in line
  std::int64_t place_revision_ = 0;
  bool left_ = false;
  // A stop or the deadline ended the acquire while its take was being settled: nothing more
  // is read (the next look finds nothing, so the core ends the acquire with false).
  bool ended_ = false;
  // A take whose outcome is unknown (its reply was lost): its request number and lease.
  std::uint64_t take_request_ = 0;
  std::shared_ptr<ClientLease> take_lease_;
  // From the last look, read at one revision:
  std::int64_t read_revision_ = 0;
  std::int64_t counter_revision_ = 0;  // the counter key's mod revision (0: no key)
  std::string ahead_;                  // the waiter just ahead of ours
};

CounterStanding EtcdCounterLine::look(bool, Deadline deadline) {
  if (ended_) return {};
  pb::TxnRequest read;  // the counter and the line ahead of us, at one revision
  add_range(read.mutable_success(), key_range(counter_key_));
  add_range(read.mutable_success(), queue_range(line_prefix_, place_revision_));
  pb::TxnResponse state;
  try {
    state = backend_.connection().txn(read, bounded(deadline, kOneShot), true, stop_);
  } catch (const CallStopped&) {
    // Nothing read: no permits seen, so the core ends the acquire on the stop (and leaves).
    CounterStanding stopped;
    stopped.in_line = !place_.empty();
    return stopped;
  }
  const auto counter = counter_value(state.responses(0).response_range());
  const auto line = children(state.responses(1).response_range(), line_prefix_);
  read_revision_ = state.header().revision();
  counter_revision_ = counter.mod_revision;
  CounterStanding standing;
  standing.value = counter.value;
  standing.ahead = line.size();
  standing.in_line = !place_.empty();
  if (!standing.in_line) return standing;
  const auto mine = std::find_if(line.begin(), line.end(), [&](const auto* kv) { return kv->key() == place_; });
  // Our key went with our lease: the core lines up again, on a new lease.
  if (mine == line.end() || backend_.lease_lost(*lease_)) throw QueueEntryGone();
  standing.ahead = static_cast<std::size_t>(mine - line.begin());
  ahead_ = standing.ahead > 0 ? (*(mine - 1))->key() : "";
  return standing;
}

bool EtcdCounterLine::take(const CounterStanding& seen, Deadline deadline) {
  const auto lease = seen.in_line ? lease_ : backend_.client_lease(bounded(deadline, kOneShot), stop_);
  const auto request = backend_.next_request();
  auto& markers = *lease->markers;
  markers.begin(request);
  const auto garbage = backend_.receipts_to_delete();
  pb::TxnRequest take;
  add_compare(take, counter_key_, pb::Compare::MOD, counter_revision_);
  markers.guard(take, request);  // never resent: this guards its one copy against leave()
  if (seen.in_line) {
    add_compare(take, place_, pb::Compare::CREATE, place_revision_);
  } else {
    // Still nobody in line: no key under the line's prefix was created since our read (keys of
    // nested names' lines, made before it, do not count; an empty range holds).
    auto* empty = take.add_compare();
    empty->set_key(line_prefix_);
    empty->set_range_end(prefix_end(line_prefix_));
    empty->set_result(pb::Compare::LESS);
    empty->set_target(pb::Compare::CREATE);
    empty->set_create_revision(read_revision_ + 1);
  }
  add_put(take.mutable_success(), counter_key_, std::to_string(*seen.value - permits_), 0);
  if (seen.in_line) add_delete(take.mutable_success(), place_);
  markers.retire(take.mutable_success(), request, kTaken);
  const auto floor = markers.add_sweep(take.mutable_success());
  for (const auto& old : garbage) add_delete(take.mutable_success(), old);
  // Kept while the outcome is unknown: a BackendUnavailable leaves the marker to leave().
  take_request_ = request;
  take_lease_ = lease;
  backend_.count_unresolved_take(*lease, +1);
  pb::TxnResponse answer;
  try {
    answer = backend_.connection().txn(take, bounded(deadline, kOneShot), false, stop_);
  } catch (const CallStopped&) {
    resolved();  // not sent: the core ends the acquire on the stop
    return false;
  } catch (const LeaseGone&) {
    // Not applied. In line, our key went with the lease (the next look joins again).
    resolved();
    backend_.lose_lease(lease, "etcd no longer knows the client's lease", true);
    return false;
  } catch (const BackendUnavailable&) {
    return take_reply_lost(deadline);  // rethrows unless the acquire ends here
  }
  resolved();
  if (!answer.succeeded()) return false;
  markers.swept(floor);
  backend_.receipts_deleted(garbage);
  left_ = true;  // our waiter key went with the take
  return true;
}

// The take's reply was lost (or the stop cut it); called in take()'s handler. A caller with a
// deadline waits for the outcome within its budget (at least kOneShot, as any call past its
// deadline), a stopped one within kOneShot, trying each endpoint briefly; untimed ones as long
// as leave() does (the error is rethrown, and the core leaves).
bool EtcdCounterLine::take_reply_lost(Deadline deadline) {
  if (!deadline && !stop_.stop_possible()) throw;
  const auto outcome = stop_.stop_requested()
                           ? settle_take(SteadyClock::now() + kOneShot, {}, kStoppedSettleAttempt)
                           : settle_take(bounded(deadline, kOneShot), stop_);
  left_ = true;  // taken: our key went with the take; otherwise the settle deletes it
  if (outcome == TakeOutcome::taken) return true;
  // Not taken, or not known yet: the background makes sure nothing stays taken.
  if (!stop_.stop_requested() && !passed(deadline)) throw;
  ended_ = true;
  return false;
}

void EtcdCounterLine::join(Deadline deadline) {
  EtcdBackend::Joined joined;
  try {
    joined = backend_.join_line(
        line_prefix_,
        [&](const ClientLease& lease, std::uint64_t number) {
          return std::pair{line_prefix_ + lease.hex + "_" + std::to_string(number),
                           std::to_string(permits_) + " " + backend_.identity() + " " + std::to_string(now_ms()) + " " +
                               std::to_string(number) + backend_.label_suffix()};
        },
        deadline, nullptr, stop_);
  } catch (const BackendUnavailable&) {
    // Stopped: not in line (a join that may have been applied is left by join_line); the core
    // ends the acquire on the stop.
    if (stop_.stop_requested()) return;
    throw;
  }
  lease_ = std::move(joined.lease);
  place_ = std::move(joined.key);
  place_revision_ = joined.created;
}

void EtcdCounterLine::wait(CounterWait wait, Deadline deadline, const std::stop_token& stop) {
  if (stop.stop_requested()) return;
  pb::WatchCreateRequest watch;
  watch.set_start_revision(read_revision_ + 1);
  if (wait == CounterWait::predecessor) {
    watch.set_key(ahead_);  // the waiter just ahead leaving
    watch.add_filters(pb::WatchCreateRequest::NOPUT);
  } else {
    watch.set_key(counter_key_);  // the counter changing
  }
  backend_.wait_for_change(*lease_, watch, deadline, stop);
}

bool EtcdCounterLine::leave() noexcept {
  if (left_) return false;
  left_ = true;
  if (!take_lease_) {
    if (!place_.empty()) backend_.run_cleanup(lease_, delete_entry_txn(place_, place_revision_), nullptr);
    return false;
  }
  return settle_take(SteadyClock::now() + kTakeOutcomeTry, stop_) == TakeOutcome::taken;
}

EtcdCounterLine::TakeOutcome EtcdCounterLine::settle_take(SteadyClock::time_point until, const std::stop_token& stop,
                                                          milliseconds attempt_cap) {
  // Its marker reads "taken" exactly when the take was applied (then it also deleted our
  // waiter key). Otherwise this Txn retires the marker, so the take can no longer apply when
  // it arrives late, and our key goes. Resent, it answers the same.
  const auto lease = std::exchange(take_lease_, nullptr);
  const auto request = std::exchange(take_request_, 0);
  pb::TxnRequest resolve;
  add_value_compare(resolve, lease->markers->marker(request), kTaken);
  add_range(resolve.mutable_success(), key_range(counter_key_));
  lease->markers->retire(resolve.mutable_failure(), request, kRefused);
  if (!place_.empty()) add_delete(resolve.mutable_failure(), place_);  // keys of one line are never reused
  auto later = undo_take(lease, request, resolve);
  const auto first_try = std::chrono::duration_cast<milliseconds>(until - SteadyClock::now());
  const auto answer = backend_.run_cleanup(
      lease, std::move(resolve), nullptr, first_try,
      [&backend = backend_, lease, request] {
        lease->markers->resolved(request);
        backend.count_unresolved_take(*lease, -1);
      },
      std::move(later), stop, attempt_cap);
  if (!answer) return TakeOutcome::unknown;
  return answer->succeeded() ? TakeOutcome::taken : TakeOutcome::not_taken;
}

// Not settled in time, the acquire reported the take not applied: the background settles it,
// and a take found applied is undone (its permits given back, its marker set to "returned",
// in one Txn on the counter's mod revision), so an acquire that did not succeed holds nothing.
std::function<void(SteadyClock::time_point)> EtcdCounterLine::undo_take(const std::shared_ptr<ClientLease>& lease,
                                                                        std::uint64_t request,
                                                                        pb::TxnRequest settle) const {
  return [&connection = backend_.connection(), lease, request, settle = std::move(settle), counter_key = counter_key_,
          permits = permits_](SteadyClock::time_point deadline) {
    const auto settled = connection.txn(settle, deadline, true);
    if (!settled.succeeded()) return;  // not applied, and now it never will be
    const auto counter = counter_value(settled.responses(0).response_range());
    pb::TxnRequest give_back;
    add_value_compare(give_back, lease->markers->marker(request), kTaken);
    add_compare(give_back, counter_key, pb::Compare::MOD, counter.mod_revision);
    add_put(give_back.mutable_success(), counter_key, std::to_string(counter.value.value_or(0) + permits), 0);
    lease->markers->retire(give_back.mutable_success(), request, kReturned);
    if (!connection.txn(give_back, deadline, true).succeeded()) {
      throw BackendUnavailable("the PermitCounter changed while a take was given back: tried again");
    }
  };
}

void EtcdCounterLine::resolved() {
  take_lease_->markers->resolved(take_request_);
  backend_.count_unresolved_take(*take_lease_, -1);
  take_request_ = 0;
  take_lease_.reset();
}

std::unique_ptr<CounterLine> EtcdBackend::counter_line(const std::string& name, std::int64_t permits,
                                                       const std::stop_token& stop) {
  return std::make_unique<EtcdCounterLine>(*this, name, permits, stop);
}

// --- inspection and the PermitCounter's plain operations -----------------------------------

Inspection EtcdBackend::inspect(const std::string& name, Deadline deadline) {
  const auto prefix = name + "/";
  pb::TxnRequest read;
  add_range(read.mutable_success(), queue_range(prefix));
  add_range(read.mutable_success(), key_range(kCounterPrefix + name));
  add_range(read.mutable_success(), queue_range(kCounterWaiterPrefix + name + "/"));
  const auto answer = connection_.txn(read, deadline ? std::min(*deadline, call_deadline()) : call_deadline(), true);
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
    info.label = entries[i].label;
    // Its key is NAME/<lease id in hex>, as etcdctl lock and concurrency.Mutex write it.
    if (entries[i].foreign) info.foreign = "etcd client (etcdctl lock), lease " + entries[i].key.substr(prefix.size());
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
    std::uint64_t number = 0;
    text >> info.permits >> info.pid >> info.host >> since_ms >> number;
    info.label = label_after(text);
    info.since = std::chrono::system_clock::time_point(milliseconds(since_ms));
    result.waiters.push_back(info);
  }
  return result;
}


// Counter changes are not idempotent: a copy of one that reaches etcd after its sender gave up
// (a stalled connection, a paused member) must change nothing. So each Txn is guarded by a
// request marker on the client's lease (request_markers.hpp) and puts it, reading "applied";
// when its reply is lost, a Txn reads the marker (applied: the call succeeded) or retires it
// ("refused": the change never applies, and is tried again). Not settled within
// kTakeOutcomeTry, it is settled in the background and the caller hears that the outcome is
// unknown: every change applies at most once.
bool EtcdBackend::counter_try_set(const std::string& name, std::int64_t permits) {
  const auto key = kCounterPrefix + name;
  const auto set = change_counter(
      key,
      [&](const CounterValue& current) -> std::optional<pb::TxnRequest> {
        if (current.value) return std::nullopt;
        pb::TxnRequest txn;
        add_compare(txn, key, pb::Compare::CREATE, 0);
        add_put(txn.mutable_success(), key, std::to_string(permits), 0);
        return txn;
      },
      0, [](const CounterValue&) { return 1; });
  return set == 1;
}

std::int64_t EtcdBackend::counter_add(const std::string& name, std::int64_t delta) {
  const auto key = kCounterPrefix + name;
  std::int64_t updated = 0;
  const auto change = [&](const CounterValue& current) -> std::optional<pb::TxnRequest> {
    if (__builtin_add_overflow(current.value.value_or(0), delta, &updated) || updated > max_permits ||
        updated < -max_permits) {
      throw InvalidArgument("PermitCounter '" + name + "': adding " + std::to_string(delta) + " to " +
                            std::to_string(current.value.value_or(0)) + " would leave [-" + std::to_string(max_permits) +
                            ", " + std::to_string(max_permits) + "]; nothing changed");
    }
    pb::TxnRequest txn;
    add_compare(txn, key, pb::Compare::MOD, current.mod_revision);
    add_put(txn.mutable_success(), key, std::to_string(updated), 0);
    return txn;
  };
  return change_counter(key, change, 0, [&](const CounterValue&) { return updated; });
}

std::optional<std::int64_t> EtcdBackend::counter_get(const std::string& name) {
  return counter_value(connection_.range(key_range(kCounterPrefix + name), call_deadline())).value;
}

std::int64_t EtcdBackend::counter_drain(const std::string& name) {
  const auto key = kCounterPrefix + name;
  const auto change = [&](const CounterValue& current) -> std::optional<pb::TxnRequest> {
    if (!current.value) return std::nullopt;
    pb::TxnRequest txn;
    add_compare(txn, key, pb::Compare::MOD, current.mod_revision);
    add_put(txn.mutable_success(), key, "0", 0);
    return txn;
  };
  return change_counter(key, change, 0, [](const CounterValue& current) { return *current.value; });
}

std::int64_t EtcdBackend::change_counter(const std::string& key, const CounterChange& change, std::int64_t unchanged,
                                         const std::function<std::int64_t(const CounterValue&)>& answer) {
  int unknown_outcomes = 0;
  for (;;) {
    const auto current = counter_value(connection_.range(key_range(key), call_deadline()));
    auto txn = change(current);
    if (!txn) return unchanged;
    if (counter_change_applied(std::move(*txn), call_deadline(), unknown_outcomes)) return answer(current);
  }
}

bool EtcdBackend::counter_change_applied(pb::TxnRequest txn, SteadyClock::time_point deadline, int& unknown_outcomes) {
  const auto lease = client_lease(deadline);
  const auto request = next_request();
  auto& markers = *lease->markers;
  markers.begin(request);
  markers.guard(txn, request);  // sent once (not resent): this guards its one copy
  markers.retire(txn.mutable_success(), request, kApplied);
  const auto floor = markers.add_sweep(txn.mutable_success());
  try {
    const auto answer = connection_.txn(txn, deadline, false);
    markers.resolved(request);
    if (answer.succeeded()) markers.swept(floor);
    return answer.succeeded();
  } catch (const LeaseGone&) {
    markers.resolved(request);  // not applied (its marker names the lease): tried on a new one
    lose_lease(lease, "etcd no longer knows the client's lease", true);
    return false;
  } catch (const BackendUnavailable& unknown) {
    // Applied or not: the marker tells, or is retired so that a late copy changes nothing.
    pb::TxnRequest settle;
    add_value_compare(settle, markers.marker(request), kApplied);
    markers.retire(settle.mutable_failure(), request, kRefused);
    const auto settled =
        run_cleanup(lease, std::move(settle), nullptr, kTakeOutcomeTry, [lease, request] { lease->markers->resolved(request); });
    if (!settled) throw;  // settled in the background; the caller hears the outcome is unknown
    if (settled->succeeded()) return true;
    if (++unknown_outcomes >= kCounterChangeTries) {
      throw BackendUnavailable("etcd did not answer a PermitCounter change " + std::to_string(kCounterChangeTries) +
                               " times (none applied, nor will any): " + unknown.what());
    }
    return false;
  } catch (const Error&) {
    markers.resolved(request);  // refused (AccessDenied): not applied
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
