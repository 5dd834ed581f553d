// The Redis backend: every state change is one Lua script (scripts/*.lua), so an uncontended
// acquire and a release are one round trip each. Everything one name needs lives in ONE hash
// (eviction or deletion takes all of it or nothing): a queue ordered by fencing tokens that
// keep growing even when that hash is lost (max(last + 1, server time in µs)), whose entries
// are leases renewed by a watchdog on its own connection every TTL/3 and reaped by the next
// script once they run out. Waiters sleep until a message names them, then ask the server: a
// message only wakes, the scripts alone admit. PermitCounter keeps Redisson's RSemaphore layout
// so Java and C++ share permits.
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <utility>

#include "backends/redis/cluster.hpp"
#include "backends/redis/connection.hpp"
#include "backends/redis/eviction.hpp"
#include "backends/redis/request_ids.hpp"
#include "backends/redis/scripts.hpp"
#include "backends/redis/subscriber.hpp"
#include "core/fork_generation.hpp"
#include "core/loss_clock.hpp"

namespace turnstile::detail::redis {
namespace {

using std::chrono::milliseconds;

// A name's key and channel share one hash tag, so a Redis Cluster keeps them in one slot. The
// tag is the name with '{', '}' and '%' percent-encoded: any name, braces included, stays whole.
std::string queue_tag(const std::string& name) {
  std::string encoded;
  for (char c : name) {
    if (c == '{' || c == '}' || c == '%') {
      char buffer[4];
      std::snprintf(buffer, sizeof buffer, "%%%02X", static_cast<unsigned char>(c));
      encoded += buffer;
    } else {
      encoded += c;
    }
  }
  return "turnstile:{" + encoded + "}:";
}

struct QueueKeys {
  std::vector<std::string> keys;  // as the scripts number them
  std::string channel;
};

// One hash per name. Pub/Sub ignores the selected database, so the channel names it: a
// release in db 0 must not even wake db 1's waiters of the same name.
QueueKeys queue_keys(const std::string& name, int db) {
  const auto tag = queue_tag(name);
  return {{tag + "q"}, tag + "w:" + std::to_string(db)};
}

// PermitCounter names that could reach turnstile's own keys: every queue key starts with
// "turnstile:" and every counter's waiter line contains ":turnstile:". Refused before anything
// is read or written, so no counter can alias a lock's state or another counter's line.
void check_counter_name(const std::string& name) {
  if (name.rfind("turnstile:", 0) == 0 || name.find(":turnstile:") != std::string::npos) {
    throw InvalidArgument("PermitCounter '" + name +
                          "': on redis:// a counter name may not start with 'turnstile:' or contain ':turnstile:' "
                          "(turnstile's own keys)");
  }
}

// Redisson's RSemaphore: the permit count is the plain key NAME, releases go to
// prefixName("redisson_sc", NAME), which adds braces only when NAME has no '{' at all.
// turnstile's waiter line must sit in NAME's cluster slot: reuse NAME's own hash tag, or make
// NAME the tag. On a cluster, a NAME with a '}' but no tag ("x}y", "a{}b") cannot be a tag,
// so a number that hashes to NAME's slot is (elsewhere such names keep the first form, as
// before, so clients of both versions share one line). The three forms differ in shape (and a
// NAME with ":turnstile:" is refused), so no two names share a line.
QueueKeys counter_keys(const std::string& name, bool cluster) {
  check_counter_name(name);
  const auto open = name.find('{');
  const auto close = open == std::string::npos ? std::string::npos : name.find('}', open + 1);
  const bool has_tag = close != std::string::npos && close > open + 1;
  const bool brace_cannot_tag = cluster && !has_tag && name.find('}') != std::string::npos;
  const std::string line = has_tag            ? name + ":turnstile:t"
                           : brace_cannot_tag ? "{" + tag_for_slot(key_slot(name)) + "}:turnstile:k:" + name
                                              : "{" + name + "}:turnstile:c";
  const std::string channel = open != std::string::npos ? "redisson_sc:" + name : "redisson_sc:{" + name + "}";
  return {{name, line}, channel};
}

std::string host_name() {
  char buffer[256] = {};
  gethostname(buffer, sizeof buffer - 1);
  return buffer;
}

char kind_code(EntryKind kind) {
  switch (kind) {
    case EntryKind::exclusive: return 'x';
    case EntryKind::shared: return 's';
    case EntryKind::lease: return 'l';
  }
  return 'x';
}

class RedisBackend;

// Every inline wait of this backend, in one place.
// A call outside any acquire (downgrade, inspect, counter changes): one reply timeout.
constexpr milliseconds kCallPatience = kReplyTimeout;
// How long a release waits for the server (see RedisHold::release and the README); a hold
// already reported lost gets one short try.
constexpr milliseconds kReleasePatience{1000};
constexpr milliseconds kLostReleasePatience{250};
// Leaving a queue or a counter's line: bounded, so a giving-up waiter returns soon; what fails
// is retired by the watchdog (retire_later).
constexpr milliseconds kLeavePatience{1000};
// How long the server remembers a client's requests (memory_ms in common_prelude.lua): at
// least this, and 2 TTLs (request_memory()). A request given up without an answer is retired
// in the background (an orphan) until it is answered, for as long at most: after that nothing
// could tell a late copy of it anyway.
constexpr milliseconds kMinRequestMemory{120'000};
// A client being destroyed gives its pending retirements (orphans) this long in all, each try
// at most kExitAttempt (a link that stopped answering is left for a new one), trying again
// after kExitRetryPause while they go unanswered.
constexpr milliseconds kExitRetirePatience{1000};
constexpr milliseconds kExitAttempt{250};
constexpr milliseconds kExitRetryPause{50};
// How long a waiter waits for the server to confirm its SUBSCRIBE; unconfirmed, the watchdog's
// rounds (which wake a waiter whose entry is admitted) cover what it may miss.
constexpr milliseconds kSubscribeConfirm{1000};
// While this client has waiters, the watchdog's round (which renews their entries too, and wakes
// those it finds admitted or gone) comes at least this often (and every TTL/3), so no lost
// message strands a waiter.
constexpr milliseconds kMaxRecheck{2000};
// Renewals: every TTL/3 but not more often than this; a round unanswered is retried after
// kMaxRenewalRetry at most (also the renewal connection's longest reconnect backoff, so a
// server back after a restart is found within it); a round waits kRenewalPatience at most.
constexpr milliseconds kMinRenewalPeriod{100};
constexpr milliseconds kMaxRenewalRetry{250};
constexpr milliseconds kRenewalPatience{1000};
// A call that must reach the server once (a join, a counter's look, take or last try) gets at
// least this to be answered even when the caller's deadline is nearer: on a healthy server a
// short deadline then ends in the server's answer (admitted, or not: a timeout), never in
// BackendUnavailable. A second covers a loaded server; an unreachable one holds it up no longer.
constexpr milliseconds kOneShotFloor{1000};
// ?min_replicas=N: WAIT gets the caller's time left, but at least this.
constexpr milliseconds kMinReplicaWait{200};

milliseconds request_memory(const Settings& settings) { return std::max<milliseconds>(kMinRequestMemory, 2 * settings.ttl); }

bool passed(Deadline deadline) { return deadline && *deadline <= SteadyClock::now(); }

// The first element of a script's array reply when it is an integer, else -1000.
long long first_integer(const redisReply* reply) {
  if (!reply || reply->type != REDIS_REPLY_ARRAY || reply->elements == 0) return -1000;
  const auto* first = reply->element[0];
  return first->type == REDIS_REPLY_INTEGER ? first->integer : -1000;
}

// The deadline of a join: the caller's, but at least kOneShotFloor from now (none stays none). A
// deadline already passed (a try-once) gets the floor too, not the connection's own caps: a
// try-once ends within it (and its clean-up goes to the watchdog, see RedisPlace::join).
Deadline at_least_floor(Deadline deadline) {
  if (!deadline) return deadline;
  return std::max(*deadline, SteadyClock::now() + kOneShotFloor);
}

// What the watchdog shares with a hold: its lease, and whether its release has begun. Once it
// has, no renewal speaks for the hold: a renewal that crossed the release finds the entry gone
// because the release removed it (the release itself reports a real loss).
struct HoldLease {
  explicit HoldLease(std::shared_ptr<ServerLease> l) : lease(std::move(l)) {}
  std::shared_ptr<ServerLease> lease;
  std::atomic<bool> releasing{false};
};

class RedisHold final : public BackendHold {
 public:
  RedisHold(RedisBackend& backend, std::string name, std::uint64_t seq, std::uint64_t join,
            std::shared_ptr<LossSignal> loss, std::shared_ptr<ServerLease> lease, std::string server);
  ~RedisHold() override;

  std::uint64_t fencing_token() const override { return seq_; }
  void downgrade() override;
  void release() override;

  const std::string& name() const { return name_; }
  std::uint64_t seq() const { return seq_; }
  const std::string& request() const { return request_; }
  const std::shared_ptr<HoldLease>& state() const { return state_; }
  // The server (Opened::server) whose script admitted the hold.
  const std::string& server() const { return server_; }

 private:
  RedisBackend& backend_;
  std::string name_;
  std::uint64_t seq_;
  std::string server_;
  std::string request_;  // the acquire's request id: the entry's owner
  std::uint64_t release_request_ = 0;  // the release's own number, the same for every try; 0 until the first
  std::shared_ptr<LossSignal> loss_;
  std::shared_ptr<ServerLease> lease_;
  std::shared_ptr<HoldLease> state_;
  bool released_ = false;
  std::uint64_t fork_generation_ = fork_generation();  // a child's copy touches nothing
};

// This process's waiters, by channel. A message only wakes a waiter: it then asks the server.
// Each sleeps on a condition variable of its own, notified only when it is poked, so a message
// that names one waiter runs one thread.
class Waiters {
 public:
  enum class Line { queue, counter };
  struct Waiter {
    std::string seq;          // queue waiters: our entry, "" until known (every message wakes us)
    std::uint64_t place = 0;  // counter waiters: our place in line, 0 until known (likewise)
    bool poked = false;
    // Queue waiters: the name and the entry's request id, and whether its entry waits in the
    // queue (the watchdog renews it then, and wakes it when the server says admitted or gone).
    std::string name, request;
    bool queued = false;
    std::condition_variable_any wake;  // notified (under the table's mutex) when poked
  };
  // A queued entry the watchdog renews.
  struct Queued {
    std::string channel, name, seq, request;
  };

  void add(Line line, const std::string& channel, Waiter& waiter) {
    std::lock_guard lock(mutex_);
    table(line)[channel].insert(&waiter);
  }
  void remove(Line line, const std::string& channel, Waiter& waiter) {
    std::lock_guard lock(mutex_);
    if (std::exchange(waiter.queued, false)) --queued_;
    auto& waiters = table(line)[channel];
    waiters.erase(&waiter);
    if (waiters.empty()) table(line).erase(channel);
  }
  // Changes what the waiter answers to, or clears its poke before it looks.
  template <typename Change>
  void update(Waiter& waiter, Change change) {
    std::lock_guard lock(mutex_);
    change(waiter);
  }
  // A queue message names the seqs it admitted; a counter message wakes the first in line.
  void on_message(const std::string& channel, const std::string& payload) {
    std::lock_guard lock(mutex_);
    if (const auto queue = queue_.find(channel); queue != queue_.end()) {
      std::set<std::string> named;
      std::istringstream seqs(payload);
      for (std::string seq; seqs >> seq;) named.insert(seq);
      for (auto* waiter : queue->second) {
        if (waiter->seq.empty() || named.count(waiter->seq)) poke(*waiter);
      }
    }
    if (const auto counter = counter_.find(channel); counter != counter_.end()) {
      Waiter* first = nullptr;
      for (auto* waiter : counter->second) {
        if (waiter->place == 0) poke(*waiter);
        else if (!first || waiter->place < first->place) first = waiter;
      }
      if (first) poke(*first);
    }
  }
  // The local counter waiter first in line (place `head`) looks again.
  void poke_counter_head(const std::string& channel, std::uint64_t head) {
    std::lock_guard lock(mutex_);
    if (const auto counter = counter_.find(channel); counter != counter_.end()) {
      for (auto* waiter : counter->second) {
        if (waiter->place == head) poke(*waiter);
      }
    }
  }
  // Marks a queue waiter's entry queued (or no longer): true when it is this client's first.
  bool set_queued(Waiter& waiter, bool queued) {
    std::lock_guard lock(mutex_);
    if (waiter.queued == queued) return false;
    waiter.queued = queued;
    queued_ += queued ? 1 : -1;
    return queued && queued_ == 1;
  }
  bool any_queued() {
    std::lock_guard lock(mutex_);
    return queued_ > 0;
  }
  std::vector<Queued> queued() {
    std::lock_guard lock(mutex_);
    std::vector<Queued> entries;
    for (const auto& [channel, waiters] : queue_) {
      for (const auto* waiter : waiters) {
        if (waiter->queued && !waiter->seq.empty()) entries.push_back({channel, waiter->name, waiter->seq, waiter->request});
      }
    }
    return entries;
  }
  // The queue waiter of entry `seq` on `channel` looks again (the watchdog found it admitted or gone).
  void poke_entry(const std::string& channel, const std::string& seq) {
    std::lock_guard lock(mutex_);
    if (const auto queue = queue_.find(channel); queue != queue_.end()) {
      for (auto* waiter : queue->second) {
        if (waiter->seq == seq) poke(*waiter);
      }
    }
  }
  void poke_all() {
    std::lock_guard lock(mutex_);
    for (auto* line : {&queue_, &counter_}) {
      for (auto& [channel, waiters] : *line) {
        for (auto* waiter : waiters) poke(*waiter);
      }
    }
  }
  // Sleeps until the waiter is poked, `until`, or a stop.
  void sleep(Waiter& waiter, SteadyClock::time_point until, const std::stop_token& stop) {
    std::unique_lock lock(mutex_);
    waiter.wake.wait_until(lock, stop, until, [&] { return waiter.poked; });
  }

 private:
  std::map<std::string, std::set<Waiter*>>& table(Line line) { return line == Line::queue ? queue_ : counter_; }
  static void poke(Waiter& waiter) {
    waiter.poked = true;
    waiter.wake.notify_all();
  }

  std::mutex mutex_;
  std::map<std::string, std::set<Waiter*>> queue_;    // channel -> waiters
  std::map<std::string, std::set<Waiter*>> counter_;  // channel -> waiters
  std::size_t queued_ = 0;  // queue waiters whose entries wait (Waiter::queued)
};

// One acquire's waiter: registered before its first script runs, so that a message published
// between that script's reply and our reading it still wakes it (to look: it proves nothing by
// itself); subscribed once it has to wait.
class Listener {
 public:
  Listener(Waiters& waiters, Subscriber& subscriber, Waiters::Line line, std::string channel)
      : waiters_(waiters), subscriber_(subscriber), line_(line), channel_(std::move(channel)),
        was_listening_(subscriber.listening(channel_)) {
    waiters_.add(line_, channel_, waiter);
  }
  ~Listener() {
    waiters_.remove(line_, channel_, waiter);
    if (subscribed_) subscriber_.unsubscribe(channel_);
  }
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  // Subscribes the first time. True when the waiter should look now rather than sleep: the
  // subscription is new, so a message published before it took was missed (when the channel
  // was listened to before our first script ran, every message since reached us).
  bool subscribe(Deadline deadline, const std::stop_token& stop) {
    if (subscribed_) return false;
    auto confirm_until = SteadyClock::now() + kSubscribeConfirm;
    if (deadline) confirm_until = std::min(confirm_until, *deadline);
    subscriber_.subscribe(channel_, confirm_until, stop);
    subscribed_ = true;
    return !was_listening_;
  }
  // Before a look: a message from now on wakes the next sleep.
  void unpoke() {
    waiters_.update(waiter, [](Waiters::Waiter& w) { w.poked = false; });
  }
  // Until a message names us (or the watchdog pokes us), the re-check interval passes (none:
  // never), the deadline, or a stop.
  void sleep(std::optional<milliseconds> recheck, Deadline deadline, const std::stop_token& stop) {
    auto until = SteadyClock::now() + recheck.value_or(std::chrono::hours(24));
    if (deadline) until = std::min(until, *deadline);
    waiters_.sleep(waiter, until, stop);
  }

  Waiters::Waiter waiter;

 private:
  Waiters& waiters_;
  Subscriber& subscriber_;
  Waiters::Line line_;
  std::string channel_;
  bool was_listening_;
  bool subscribed_ = false;
};

class RedisBackend final : public Backend {
 public:
  RedisBackend(Settings settings, EvictionRule eviction, ErrorHandler warn, const std::string& label)
      : settings_(settings),
        identity_(std::to_string(getpid()) + " " + host_name()),
        label_suffix_(label.empty() ? "" : " " + label),
        wake_fd_(make_wake_fd()),
        request_ids_(request_memory(settings).count()),
        connection_(with_eviction_rule(settings, eviction), all_scripts(), [this](const std::string& server) { on_server_changed(server); }),
        renewals_(settings, all_scripts(), [this](const std::string& server) { on_server_changed(server); },
                  renewal_retry()),
        subscriber_(settings, [this](const std::string& channel, const std::string& payload) { waiters_.on_message(channel, payload); },
                    [this] { on_subscriber_reset(); }) {
    check_eviction_policy(connection_, settings_, eviction, warn);
    watchdog_ = std::jthread([this](std::stop_token stop) { watchdog_loop(stop); });
  }

  ~RedisBackend() override {
    watchdog_.request_stop();
    renew_soon();  // wakes the watchdog
    if (watchdog_.joinable()) watchdog_.join();
    retire_orphans_before_exit();
    // The subscriber's thread joins next; the eventfd outlives it (declared first).
  }

  std::unique_ptr<QueuePlace> join(const QueueRequest& request, bool try_once, Deadline deadline,
                                   Standing& first) override;
  std::unique_ptr<CounterLine> counter_line(const std::string& name, std::int64_t permits,
                                            const std::stop_token& stop) override;
  Inspection inspect(const std::string& name, Deadline deadline) override;
  bool counter_try_set(const std::string& name, std::int64_t permits) override;
  std::int64_t counter_add(const std::string& name, std::int64_t delta) override;
  std::optional<std::int64_t> counter_get(const std::string& name) override;
  std::int64_t counter_drain(const std::string& name) override;

  Router& connection() { return connection_; }
  RequestIds& request_ids() { return request_ids_; }
  QueueKeys keys_of(const std::string& name) const { return queue_keys(name, settings_.db); }
  // How long a release is remembered, so a resend after a lost reply is recognised.
  std::string release_memory_ms() const {
    return std::to_string(request_memory(settings_).count());
  }
  void track(RedisHold* hold) {
    std::lock_guard lock(holds_mutex_);
    holds_.insert(hold);
    // A primary change noticed between the admitting script's reply and now.
    if (settings_.sentinel() && !primary_.empty() && hold->server() != primary_) {
      hold->state()->lease->lose(primary_changed(hold->server(), primary_));
    }
    if (settings_.cluster() && demoted(connection_, *hold->state(), hold->name(), hold->server())) {
      hold->state()->lease->lose(primary_changed(hold->server(), connection_.owner(keys_of(hold->name()).keys.front())));
    }
    // The watchdog notices a node going away through its own idle connection to it: on a node
    // it has none to yet, it renews now, which opens one (else a node killed and restarted
    // empty before the first round went unnoticed for up to TTL/3).
    if (settings_.cluster() && !renewals_.knows_node(hold->server().substr(0, hold->server().find(' ')))) renew_soon();
  }
  // With sentinels: WAIT for min_replicas after the script that admits an entry (a FollowUp
  // for Connection::eval; none without min_replicas). `admitted` reads the script's reply.
  FollowUp replica_wait(Deadline deadline, bool (*admitted)(const redisReply*)) const;
  // Throws NotReplicated unless `reply` (WAIT's) counts min_replicas replicas.
  void check_replicas(const Reply& reply) const;
  void untrack(RedisHold* hold) {
    std::lock_guard lock(holds_mutex_);
    holds_.erase(hold);
  }

 private:
  friend class RedisPlace;
  friend class RedisCounterLine;

  milliseconds recheck_interval() const { return std::min(kMaxRecheck, settings_.ttl / 3); }
  milliseconds renewal_period() const { return std::max(kMinRenewalPeriod, settings_.ttl / 3); }
  milliseconds renewal_retry() const { return std::min(renewal_period(), kMaxRenewalRetry); }
  static int make_wake_fd() {
    const int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fd < 0) throw BackendUnavailable("eventfd failed");
    return fd;
  }
  void on_subscriber_reset();
  // A new connection found another server. With sentinels every hold admitted by another
  // server than `server` is lost: a failover (or a restart) may have lost its entry, or handed
  // the name to someone else, and the holder must not go on believing it holds.
  void on_server_changed(const std::string& server);
  static std::string primary_changed(const std::string& was, const std::string& now);
  // host:port of a server (Opened::server: "host:port run_id").
  static std::string address_of(const std::string& server) { return server.substr(0, server.find(' ')); }
  // With a cluster: by `router`'s map, the node that admitted a hold (`server`) serves the
  // name's slot no more and no slot at all: a failover demoted it, or it is gone. (A node that
  // only gave the slot away to a resharding, or admitted the hold through ASK while the slot
  // moves to it, still serves slots: the renewal's answer decides then, by which node answers.)
  bool demoted(Router& router, const HoldLease& state, const std::string& name, const std::string& server) {
    const auto owner = router.owner(keys_of(name).keys.front());
    return !state.releasing && !owner.empty() && owner != address_of(server) && !router.serves_slots(address_of(server));
  }
  void renew_soon();
  void watchdog_loop(std::stop_token stop);
  // What the watchdog renews: a hold's lease, by seq and request id.
  struct Renewal {
    std::shared_ptr<HoldLease> state;
    std::string seq, request;
    std::string server;  // that admitted the hold
  };
  // One pipelined round of renewals and orphan removals. False when something went unanswered
  // (the next round comes after renewal_retry()).
  // `stop`: the watchdog's, which ends a round in flight (a client being destroyed).
  bool renewal_round(const std::stop_token& stop);
  // Applies a name's renewal reply to its holds (the first answers; `queued` waiting entries'
  // answers follow). False when it confirmed nothing for one of them.
  bool settle_renewals(const std::vector<Renewal>& holds, const Result& result, SteadyClock::time_point sent_at,
                       const std::string& server, std::size_t queued);
  // Takes the entry of the acquire numbered `join` out of the queue (by seq when known),
  // bounded; when that fails, the watchdog keeps trying (an entry left behind would hold the
  // name up for a TTL). Either way the acquire is retired: a copy of it delivered late creates
  // nothing. `settle_join`: the acquire's outcome was unknown, its number is still in flight.
  // `patience`: how long to wait for the server before the watchdog takes over (0: at once).
  void leave(const std::string& name, const std::string& seq, std::uint64_t join, bool settle_join,
             milliseconds patience = kLeavePatience) noexcept;
  // Runs a counter change once (its request marked with a fresh number); when its outcome is
  // unknown, the request is retired in the background before the error reaches the caller.
  Reply counter_change(const QueueKeys& keys, const Script& script,
                       const std::function<std::vector<std::string>(const std::string& marked)>& args_with);

  Settings settings_;
  std::string identity_;  // "<pid> <host>", for inspect
  std::string label_suffix_;  // " <holder label>" after the entry's since, or "" (for inspect)
  // Wakes the watchdog (renew now, or stop). Closed last, after every thread that uses it.
  struct WakeFd {
    int fd;
    ~WakeFd() { close(fd); }
  } wake_fd_;
  RequestIds request_ids_;
  LossClock loss_clock_;  // before every hold's lease
  Router connection_;
  Router renewals_;  // the watchdog's own: renewals never queue behind other calls
  Waiters waiters_;

  // Requests given up without an answer (Curator's guaranteed delete is the model): an entry
  // whose removal failed or whose creation's outcome is unknown, a counter change or take whose
  // outcome is unknown. Each is one idempotent script call that retires the request (so that a
  // copy delivered late changes nothing), retried in the watchdog's rounds until answered; the
  // numbers it settles stay in flight (holding their key's watermark) until then.
  struct Orphan {
    const Script* script;
    std::vector<std::string> keys, args;
    std::string key;                     // the key whose request numbers `settles` are
    std::vector<std::uint64_t> settles;  // settled once it is answered (or given up)
    SteadyClock::time_point give_up;
    std::uint64_t serial = 0;
  };
  void retire_later(Orphan orphan);
  void retire_orphans_before_exit() noexcept;

  std::mutex holds_mutex_;
  std::set<RedisHold*> holds_;
  std::string primary_;  // with sentinels: the server the latest new connection found
  std::vector<Orphan> orphans_;
  std::uint64_t orphan_serial_ = 0;

  Subscriber subscriber_;  // after the waiter tables: its thread calls into them
  std::jthread watchdog_;  // last: stopped and joined first
};

RedisHold::RedisHold(RedisBackend& backend, std::string name, std::uint64_t seq, std::uint64_t join,
                     std::shared_ptr<LossSignal> loss, std::shared_ptr<ServerLease> lease, std::string server)
    : backend_(backend), name_(std::move(name)), seq_(seq), server_(std::move(server)),
      request_(backend.request_ids().id(join)), loss_(std::move(loss)),
      lease_(std::move(lease)), state_(std::make_shared<HoldLease>(lease_)) {
  lease_->attach(loss_);
  backend_.track(this);
}

RedisHold::~RedisHold() {
  // A forked child's copy of the parent's hold: the parent's threads may have held these
  // mutexes at the fork, and the entry is the parent's. Nothing is touched, nothing is sent.
  if (fork_generation_ != fork_generation()) return;
  lease_->detach(loss_.get());
  if (!released_) backend_.untrack(this);  // the core releases first; this only guards misuse
  if (release_request_ != 0) backend_.request_ids().settle(backend_.keys_of(name_).keys.back(), release_request_);
}

void RedisHold::downgrade() {
  const auto keys = backend_.keys_of(name_);
  auto reply = backend_.connection().eval(scripts::downgrade, keys.keys, {keys.channel, std::to_string(seq_), request_},
                                          SteadyClock::now() + kCallPatience, true);
  if (integer_of(reply) == 0) lease_->lose("its entry expired or the redis server forgot it");
}

void RedisHold::release() {
  if (released_) return;
  const auto keys = backend_.keys_of(name_);
  // Bounded: at most kReleasePatience, and no longer once the hold is reported lost (a hold
  // already lost gets one short try): the caller must hear of a loss at once, and the core
  // retries a failed release in the background. A resend after a lost reply finds the release
  // remembered, not a loss.
  const bool lost = loss_->lost_by_now();
  const auto patience = lost ? kLostReleasePatience : kReleasePatience;
  // From now on a renewal that finds the entry gone may have crossed this release: only the
  // release's own answer says whether the hold was lost.
  state_->releasing = true;
  auto& ids = backend_.request_ids();
  if (release_request_ == 0) release_request_ = ids.open(keys.keys.back());
  auto reply = backend_.connection().eval(scripts::release, keys.keys,
                                          {keys.channel, std::to_string(seq_), request_, backend_.release_memory_ms(),
                                           ids.marked(keys.keys.back(), release_request_)},
                                          SteadyClock::now() + patience, true, nullptr,
                                          lost ? std::stop_token() : loss_->token());
  ids.settle(keys.keys.back(), std::exchange(release_request_, 0));
  released_ = true;
  backend_.untrack(this);
  if (integer_of(reply) == 0) {
    lease_->lose("its entry had expired or the redis server forgot it before the release");
  } else {
    lease_->detach(loss_.get());
  }
}

void RedisBackend::on_subscriber_reset() {
  waiters_.poke_all();
  // The subscriber lost its connection and made a new one: the server may have restarted
  // without the holds' entries. One renewal round finds out.
  renew_soon();
}

std::string RedisBackend::primary_changed(const std::string& was, const std::string& now) {
  const auto address = address_of;
  return "the redis primary changed (a failover or a restart: the hold was taken on " + address(was) +
         (address(was) == address(now) ? " before it restarted" : ", the primary is now " + address(now)) +
         "); replication is asynchronous, so its entry may be gone or the name handed to another";
}

void RedisBackend::on_server_changed(const std::string& server) {
  if (settings_.cluster() && !server.empty()) {
    // A node came back as another boot of itself (a restart): what it admitted before is gone.
    std::lock_guard lock(holds_mutex_);
    for (auto* hold : holds_) {
      if (address_of(hold->server()) == address_of(server) && hold->server() != server && !hold->state()->releasing) {
        hold->state()->lease->lose(primary_changed(hold->server(), server));
      }
    }
  }
  if (settings_.sentinel()) {
    // Both connections follow: no call goes to the old primary any more.
    connection_.follow(server);
    renewals_.follow(server);
    std::lock_guard lock(holds_mutex_);
    primary_ = server;
    for (auto* hold : holds_) {
      if (hold->server() != server && !hold->state()->releasing) {
        hold->state()->lease->lose(primary_changed(hold->server(), server));
      }
    }
  }
  renew_soon();
}

FollowUp RedisBackend::replica_wait(Deadline deadline, bool (*admitted)(const redisReply*)) const {
  if (settings_.min_replicas <= 0) return {};
  const auto replicas = settings_.min_replicas;
  return [deadline, admitted, replicas](const std::vector<Reply>& replies) -> std::optional<Command> {
    if (replies.empty() || !admitted(replies.front().get())) return std::nullopt;
    // The caller's time left, at least kMinReplicaWait (a try-once or a deadline about to pass
    // still gets a chance), at most kConnectTimeout.
    auto wait = kConnectTimeout;
    if (deadline) {
      const auto left = std::chrono::ceil<milliseconds>(*deadline - SteadyClock::now());
      wait = std::clamp(left, kMinReplicaWait, kConnectTimeout);
    }
    return Command{"WAIT", std::to_string(replicas), std::to_string(wait.count())};
  };
}

void RedisBackend::check_replicas(const Reply& reply) const {
  const auto need = settings_.min_replicas;
  if (!reply) {
    throw NotReplicated("redis at " + settings_.description + ": no answer to WAIT " + std::to_string(need) +
                        " (min_replicas); nothing was taken");
  }
  if (reply->type == REDIS_REPLY_INTEGER && reply->integer >= need) return;
  if (reply->type == REDIS_REPLY_INTEGER) {
    throw NotReplicated("redis at " + settings_.description + ": the entry reached " + std::to_string(reply->integer) +
                        " replica(s) in time, min_replicas=" + std::to_string(need) + " asked for " +
                        std::to_string(need) + "; nothing was taken");
  }
  throw NotReplicated("redis at " + settings_.description + " refused WAIT " + std::to_string(need) +
                      " (min_replicas): " + redacted(settings_, reply->str ? std::string_view(reply->str, reply->len) : "") +
                      "; nothing was taken");
}

void RedisBackend::leave(const std::string& name, const std::string& seq, std::uint64_t join, bool settle_join,
                         milliseconds patience) noexcept {
  try {
    const auto keys = keys_of(name);
    const auto& key = keys.keys.back();
    const auto release = request_ids_.open(key);
    std::vector<std::uint64_t> settles{release};
    if (settle_join) settles.push_back(join);
    std::vector<std::string> args{keys.channel, seq, request_ids_.id(join), release_memory_ms(),
                                  request_ids_.marked(key, release)};
    try {
      if (patience.count() > 0) {
        integer_of(connection_.eval(scripts::release, keys.keys, args, SteadyClock::now() + patience, true));
        for (const auto n : settles) request_ids_.settle(key, n);
        return;
      }
    } catch (...) {
    }
    retire_later({&scripts::release, keys.keys, std::move(args), key, std::move(settles), {}});
  } catch (...) {
  }
}

void RedisBackend::retire_later(Orphan orphan) {
  {
    std::lock_guard lock(holds_mutex_);
    orphan.give_up = SteadyClock::now() + request_memory(settings_);
    orphan.serial = ++orphan_serial_;
    orphans_.push_back(std::move(orphan));
  }
  renew_soon();
}

// A client ending with requests still to retire (a give-up whose clean-up has not got through:
// the server stalled, or the link is cut) tries them once more, all in one round trip per node,
// again until they are answered or kExitRetirePatience has passed. Whatever is still unanswered
// then is dropped: a copy of it reaching the server later may still apply (the README's Redis
// section: a client that ends during a partition).
void RedisBackend::retire_orphans_before_exit() noexcept {
  try {
    std::vector<Orphan> orphans;
    {
      std::lock_guard lock(holds_mutex_);
      orphans.swap(orphans_);
    }
    const auto until = SteadyClock::now() + kExitRetirePatience;
    while (!orphans.empty() && SteadyClock::now() < until) {
      std::vector<ScriptCall> calls;
      for (const auto& orphan : orphans) calls.emplace_back(orphan.script, orphan.keys, orphan.args);
      std::vector<Result> results;
      try {
        results = renewals_.eval_each(calls, std::min(until, SteadyClock::now() + kExitAttempt));
      } catch (const std::exception&) {
        std::this_thread::sleep_for(std::min<SteadyClock::duration>(kExitRetryPause, until - SteadyClock::now()));
        continue;
      }
      std::vector<Orphan> unanswered;
      for (std::size_t i = 0; i < orphans.size(); ++i) {
        if (!results[i].ok()) unanswered.push_back(std::move(orphans[i]));
      }
      orphans.swap(unanswered);
      if (!orphans.empty()) std::this_thread::sleep_for(std::min<SteadyClock::duration>(kExitRetryPause, until - SteadyClock::now()));
    }
  } catch (...) {
  }
}

// Our entry in a name's queue. The Lua scripts evaluate the queue atomically (admit()), so every
// look answers with the verdict itself: admitted or waiting.
class RedisPlace final : public QueuePlace {
 public:
  RedisPlace(RedisBackend& backend, const QueueRequest& request, bool may_wait)
      : backend_(backend), name_(request.name), keys_(backend.keys_of(request.name)),
        join_(backend.request_ids_.open(keys_.keys.back())), request_id_(backend.request_ids_.id(join_)),
        stop_(request.stop) {
    if (may_wait) {
      listener_.emplace(backend.waiters_, backend.subscriber_, Waiters::Line::queue, keys_.channel);
      backend.waiters_.update(listener_->waiter, [&](Waiters::Waiter& w) {
        w.name = name_;
        w.request = request_id_;
      });
    }
  }

  ~RedisPlace() override {
    // An acquire that ended in an error reply: the server changed nothing.
    if (!join_answered_ && !left_) backend_.request_ids_.settle(keys_.keys.back(), join_);
  }

  // Runs the acquire script: admitted or not; none when no entry stays (not admitted on a
  // try-once, or a stop during the call, after which the entry it may have made has left).
  // At least kOneShotFloor, whatever the deadline: the answer decides (admitted: the hold; not,
  // with the deadline passed: the core leaves and reports a timeout).
  std::optional<bool> join(const QueueRequest& request, bool try_once, Deadline deadline) {
    const auto sent_at = SteadyClock::now();
    Reply reply;
    Reply replicas;  // WAIT's answer, with min_replicas and an admitted entry
    const auto follow_up = backend_.replica_wait(deadline, [](const redisReply* r) { return first_integer(r) == 1; });
    try {
      reply = backend_.connection_.eval(
          scripts::acquire, keys_.keys,
          {keys_.channel, std::string(1, kind_code(request.kind)), std::to_string(request.permits),
           std::to_string(request.limit), std::to_string(backend_.settings_.ttl.count()), try_once ? "1" : "0",
           backend_.request_ids_.marked(keys_.keys.back(), join_), backend_.identity_, backend_.label_suffix_},
          at_least_floor(deadline), true, &server_, stop_, &follow_up, &replicas);
      // Answered: the server knows what this acquire did, and a late copy of it finds that out.
      backend_.request_ids_.settle(keys_.keys.back(), join_);
      join_answered_ = true;
    } catch (const BackendUnavailable&) {
      // The script may have run and its reply been lost: take out the entry it may have made
      // (found by our request id) rather than leave it to hold up the name for a TTL. A one-shot
      // join (deadline within the floor) ends within its floor: the leave gets what is left of
      // it, then the watchdog retires the request.
      const auto floor_end = sent_at + kOneShotFloor;
      const bool one_shot = deadline && *deadline <= floor_end;
      leave_within(one_shot ? std::max(milliseconds(0), std::chrono::duration_cast<milliseconds>(floor_end - SteadyClock::now()))
                            : kLeavePatience);
      if (stop_.stop_requested()) return std::nullopt;
      throw;
    }
    const auto status = integer_at(reply.get(), 0);
    if (status == -1) check_queue_mode(request, string_at(reply.get(), 1) == "lock" ? QueueMode::lock : QueueMode::semaphore, 0);
    if (status == -2) check_queue_mode(request, QueueMode::semaphore, integer_at(reply.get(), 1));
    if (status == 0) return std::nullopt;
    if (status != 1 && status != 2) throw BackendUnavailable("redis answered acquire with status " + std::to_string(status));
    seq_ = token_at(reply.get(), 1);
    if (listener_) backend_.waiters_.update(listener_->waiter, [&](Waiters::Waiter& w) { w.seq = std::to_string(seq_); });
    if (status == 1 && backend_.settings_.min_replicas > 0) {
      try {
        backend_.check_replicas(replicas);
      } catch (...) {
        leave();  // nothing is left behind: the entry goes
        throw;
      }
    }
    if (status == 1) admitted_at_ = sent_at;
    // Waiting: from now on the watchdog renews our entry with the client's others of the name,
    // and wakes us when it finds it admitted or gone (a message lost, or an entry ahead expired).
    if (status == 2 && listener_ && backend_.waiters_.set_queued(listener_->waiter, true)) backend_.renew_soon();
    return status == 1;
  }

  Standing look(Deadline deadline) override {
    // A stop ends the wait without asking: the core gives up on "waiting" and leaves.
    if (stop_.stop_requested()) return standing(false);
    if (listener_) listener_->unpoke();
    const auto sent_at = SteadyClock::now();
    Reply reply;
    Reply replicas;  // WAIT's answer, with min_replicas once admitted
    const auto follow_up = backend_.replica_wait(deadline, [](const redisReply* r) { return first_integer(r) == 2; });
    try {
      reply = backend_.connection_.eval(
          scripts::renew, keys_.keys,
          {keys_.channel, std::to_string(backend_.settings_.ttl.count()), std::to_string(seq_), request_id_}, deadline,
          true, &server_, stop_, &follow_up, &replicas);
    } catch (const BackendUnavailable&) {
      // Ended by the stop or the deadline: not admitted (the core gives up and leaves).
      if (stop_.stop_requested() || passed(deadline)) return standing(false);
      throw;
    }
    const auto where = integer_at(reply.get(), 0);
    if (where == 0) {
      // Gone (we were paused past the TTL, or the server lost the name's state): nothing to leave.
      left_ = true;
      if (listener_) backend_.waiters_.set_queued(listener_->waiter, false);
      throw QueueEntryGone();
    }
    // Not replicated: NotReplicated ends the acquire, and the core takes our entry out.
    if (where == 2 && backend_.settings_.min_replicas > 0) backend_.check_replicas(replicas);
    if (where == 2) admitted_at_ = sent_at;
    return standing(where == 2);
  }

  // Whatever the verdict names, the script that admits us publishes our seq: we sleep until a
  // message names us, the subscriber reconnects, or the watchdog's round (every TTL/3 and at
  // most kMaxRecheck apart while we wait) finds our entry admitted or gone. Sleeping, a waiter
  // sends nothing: its lease is renewed by that round, in one call for all of the client's
  // entries of the name.
  void wait(const Verdict&, Deadline deadline, const std::stop_token& stop) override {
    if (!listener_ || listener_->subscribe(deadline, stop)) return;
    listener_->sleep(std::nullopt, deadline, stop);
  }

  std::unique_ptr<BackendHold> hold(std::shared_ptr<LossSignal> loss) override {
    left_ = true;  // the hold owns the entry now
    if (listener_) backend_.waiters_.set_queued(listener_->waiter, false);
    // The lease counts from the send time of the script that found us admitted.
    return std::make_unique<RedisHold>(backend_, name_, seq_, join_, std::move(loss),
                                       backend_.loss_clock_.watch(backend_.settings_.ttl, admitted_at_), server_);
  }

  void leave() noexcept override { leave_within(kLeavePatience); }
  void leave_within(milliseconds patience) noexcept {
    if (std::exchange(left_, true)) return;
    if (listener_) backend_.waiters_.set_queued(listener_->waiter, false);
    // By request id alone while the seq is unknown (the acquire's reply was lost).
    backend_.leave(name_, seq_ ? std::to_string(seq_) : std::string(), join_, !join_answered_, patience);
  }

  // The script decided; the queue is in our mode (it refuses a request of another).
  Standing standing(bool admitted) const {
    Standing standing;
    standing.decided = admitted ? Verdict{} : Verdict{WaitFor::admission, 0};
    return standing;
  }

 private:
  RedisBackend& backend_;
  std::string name_;
  QueueKeys keys_;
  // One id per entry: a release by request id finds it even when the acquire's reply was lost.
  std::uint64_t join_;
  std::string request_id_;
  bool join_answered_ = false;  // else its number stays in flight until the leave retires it
  std::stop_token stop_;
  std::optional<Listener> listener_;  // none on a try-once: it never waits
  std::uint64_t seq_ = 0;             // 0 until the acquire answered
  std::string server_;                // the server that answered the last script (Opened::server)
  SteadyClock::time_point admitted_at_{};
  bool left_ = false;
};

std::unique_ptr<QueuePlace> RedisBackend::join(const QueueRequest& request, bool try_once, Deadline deadline,
                                               Standing& first) {
  auto place = std::make_unique<RedisPlace>(*this, request, !try_once);
  const auto admitted = place->join(request, try_once, deadline);
  if (!admitted) return nullptr;
  first = place->standing(*admitted);
  return place;
}

// One PermitCounter acquire. counter_acquire.lua decides in one step: it takes the permits when
// we are first in line (or the line is empty) and the count has them, else places us in line.
class RedisCounterLine final : public CounterLine {
 public:
  RedisCounterLine(RedisBackend& backend, const std::string& name, std::int64_t permits, std::stop_token stop)
      : backend_(backend), keys_(counter_keys(name, backend.settings_.cluster())), permits_(permits),
        request_(backend.request_ids_.open(keys_.keys.back())), stop_(std::move(stop)),
        listener_(backend.waiters_, backend.subscriber_, Waiters::Line::counter, keys_.channel) {}
  // The acquire's number is in flight until it is settled: taken, or left (answered), or handed
  // to the background retire.
  ~RedisCounterLine() override {
    if (!retiring_) backend_.request_ids_.settle(keys_.keys.back(), request_);
  }

  // The last try (the deadline passed, or a stop) takes or leaves the line; see run() for its time.
  CounterStanding look(bool last_try, Deadline deadline) override { return run(last_try ? "1" : "0", deadline); }
  bool take(const CounterStanding& seen, Deadline deadline) override {
    return run(seen.in_line ? "0" : "1", deadline).taken;
  }
  // A look already placed us in line; otherwise this does (a take by it shows at the next look).
  void join(Deadline deadline) override {
    if (!in_line_) run("0", deadline);
  }
  void wait(CounterWait, Deadline deadline, const std::stop_token& stop) override {
    if (listener_.subscribe(deadline, stop)) return;
    listener_.sleep(backend_.recheck_interval(), deadline, stop);
  }
  bool leave() noexcept override {
    if (settled_) return taken_;
    try {
      taken_ = run_script("2", SteadyClock::now() + kLeavePatience, {}).taken;  // not ended by the stop
    } catch (...) {
      // Unanswered: a look of ours may still arrive, or may have taken the permits. Retired in
      // the background: a take it made is given back (we report "not taken"), our place goes,
      // and a look delivered later changes nothing.
      try {
        retiring_ = true;
        backend_.retire_later({&scripts::counter_retire, keys_.keys,
                               {keys_.channel, marked(), std::to_string(permits_)}, keys_.keys.back(), {request_}, {}});
      } catch (...) {
      }
    }
    settled_ = true;
    return taken_;
  }

 private:
  // Every call but a leave: at least kOneShotFloor, so a short deadline on a healthy server ends
  // in the script's answer; without a deadline kCallPatience (the line's calls are all bounded);
  // ended at once by the caller's stop. After a stop we leave (bounded) and report "not taken,
  // waiting" (the core then gives up), or taken when the leave finds that a call we cut short
  // had taken the permits.
  CounterStanding run(const char* mode, Deadline deadline) {
    if (!stop_.stop_requested()) {
      try {
        const auto now = SteadyClock::now();
        return run_script(mode, deadline ? std::max(*deadline, now + kOneShotFloor) : now + kCallPatience, stop_);
      } catch (const BackendUnavailable&) {
        if (!stop_.stop_requested() && deadline) throw;
        if (!stop_.stop_requested()) {
          // No deadline: wait through an outage as a queue waiter does. Counted as still in
          // line; the next look resends with our request id, which finds our place or our take.
          CounterStanding waiting;
          waiting.in_line = in_line_ = true;
          waiting.ahead = 1;
          return waiting;
        }
      }
    }
    CounterStanding standing;
    standing.taken = leave();
    standing.in_line = !standing.taken;
    standing.ahead = standing.taken ? 0 : 1;
    return standing;
  }

  // Runs counter_acquire in `mode`: "0" take or wait in line, "1" take or leave, "2" only leave.
  // The script remembers a take by our request id, so a resend after a lost reply says taken.
  CounterStanding run_script(const char* mode, Deadline until, const std::stop_token& stop) {
    listener_.unpoke();
    settled_ = false;  // until answered, a lost reply may have placed us or taken the permits
    auto reply = backend_.connection_.eval(scripts::counter_acquire, keys_.keys,
                                           {keys_.channel, std::to_string(permits_),
                                            std::to_string(backend_.settings_.ttl.count()), mode, backend_.identity_,
                                            marked(), backend_.label_suffix_},
                                           until, true, nullptr, stop);
    CounterStanding standing;
    const auto status = integer_at(reply.get(), 0);
    if (status == 0 || status == 1) {
      settled_ = true;
      in_line_ = false;
      standing.taken = taken_ = status == 1;
      return standing;  // not taken: out of the line, and the count was short (value unknown)
    }
    if (status != 2) throw BackendUnavailable("redis answered counter_acquire with status " + std::to_string(status));
    const auto place = token_at(reply.get(), 1);
    const auto head = token_at(reply.get(), 2);
    backend_.waiters_.update(listener_.waiter, [&](Waiters::Waiter& w) { w.place = place; });
    // The message that woke us may have been meant for the first in line: if that is one of
    // ours, it looks now rather than at its next re-check.
    if (head != place) backend_.waiters_.poke_counter_head(keys_.channel, head);
    in_line_ = standing.in_line = true;
    standing.ahead = head == place ? 0 : 1;  // the script tells first or not, not how many
    return standing;
  }

  RedisBackend& backend_;
  QueueKeys keys_;
  std::int64_t permits_;
  // The acquire's request (marked with the key's watermark at each send).
  std::string marked() { return backend_.request_ids_.marked(keys_.keys.back(), request_); }

  std::uint64_t request_;  // the same for every look: a resend finds our place or our take
  bool retiring_ = false;  // handed to the background retire, which settles it
  std::stop_token stop_;   // the caller's: every call but a leave ends on it
  Listener listener_;       // registered before the first look
  bool in_line_ = false;
  bool settled_ = true;  // known out of the line (or taken): leave() has nothing to do
  bool taken_ = false;   // what the last answer said of our take (leave() repeats it)
};

std::unique_ptr<CounterLine> RedisBackend::counter_line(const std::string& name, std::int64_t permits,
                                                        const std::stop_token& stop) {
  return std::make_unique<RedisCounterLine>(*this, name, permits, stop);
}

void RedisBackend::renew_soon() {
  const std::uint64_t one = 1;
  [[maybe_unused]] auto written = write(wake_fd_.fd, &one, sizeof one);
}

// Renews every hold every TTL/3 on its own connection, in one pipelined round trip. What the
// server answers for each entry decides: present, ours and admitted → confirmed (the loss
// clock counts from the renewal's send time); gone, or not ours, or no longer admitted → lost,
// unless the hold's release has begun (the release answers for it then). A round unanswered
// within min(TTL/3, 1 s), or answered with an error, suspends the holds and is tried again
// 250 ms later (the connection reconnects as often). The LossClock reports a hold lost when no
// renewal was confirmed for TTL − margin, whatever this thread is doing. The next round starts
// at once when the server shows a change: the idle renewal connection gets an EOF or reset (a
// restart or shutdown: this thread sleeps in poll() on it), the subscriber reconnects, or a
// connection finds another run_id. Entries whose removal failed (orphans) are removed in the
// same round trips until done. The client's waiting entries are renewed in the same calls (one
// per name: renew.lua reads only the entries it names, unless one of the name's has expired),
// and a waiter whose entry the server calls admitted or gone is woken to look; while there are
// waiters, rounds come every min(TTL/3, kMaxRecheck).
void RedisBackend::watchdog_loop(std::stop_token stop) {
  auto wait = renewal_period();
  while (!stop.stop_requested()) {
    const auto until = SteadyClock::now() + wait;
    while (!stop.stop_requested() && SteadyClock::now() < until) {
      if (renewals_.watch_idle(until, wake_fd_.fd)) break;  // the server went away: look now
      std::uint64_t count;
      if (read(wake_fd_.fd, &count, sizeof count) > 0) break;  // renew_soon(), or stop
    }
    if (stop.stop_requested()) break;
    wait = !renewal_round(stop)     ? renewal_retry()
           : waiters_.any_queued() ? std::min(renewal_period(), recheck_interval())
                                   : renewal_period();
  }
}

bool RedisBackend::renewal_round(const std::stop_token& stop) {
  // A snapshot (leases are shared: a hold may be released and destroyed meanwhile).
  struct Entries {
    std::vector<Renewal> holds;
    std::vector<Waiters::Queued> queued;  // after the holds, in the same call
  };
  std::map<std::string, Entries> by_name;
  for (auto& queued : waiters_.queued()) by_name[queued.name].queued.push_back(std::move(queued));
  std::vector<Orphan> orphans;
  {
    std::lock_guard lock(holds_mutex_);
    for (auto* hold : holds_) {
      // A hold being released is still renewed (a release that failed is retried later and
      // its entry must not expire under it meanwhile), but its answers are ignored.
      if (!hold->state()->lease->lost()) {
        by_name[hold->name()].holds.push_back({hold->state(), std::to_string(hold->seq()), hold->request(), hold->server()});
      }
    }
    const auto now = SteadyClock::now();
    std::erase_if(orphans_, [&](const Orphan& orphan) {
      if (orphan.give_up > now) return false;
      for (const auto n : orphan.settles) request_ids_.settle(orphan.key, n);
      return true;
    });
    orphans = orphans_;
  }
  if (settings_.sentinel()) {
    // A demoted primary may accept our calls for seconds after the failover (until the
    // sentinels reconfigure it, ~10 s): ask them, every round, holds or not. When they name
    // another, both connections drop theirs: waiters look and acquires go to the new primary,
    // and the renewals below reach it, whose new server loses the holds (on_server_changed).
    try {
      const auto primary = ask_sentinels(settings_, SteadyClock::now() + std::min(renewal_period(), kRenewalPatience));
      const auto host = primary.host.starts_with('[') ? primary.host.substr(1, primary.host.size() - 2) : primary.host;
      const auto address = host + ":" + std::to_string(primary.port);
      connection_.primary_moved(address);
      renewals_.primary_moved(address);
    } catch (const std::exception&) {
      // No sentinel answered: the renewal itself says what the primary we know thinks.
    }
  }
  if (settings_.cluster()) {
    // As with sentinels: the slot map, read again every round, holds or not. A hold whose node
    // a failover demoted is lost, and not renewed on the new primary: its entry there, if
    // replication carried it, runs out by its TTL. Any other hold is renewed, and lost when
    // another node than its own answers (settle_renewals).
    renewals_.refresh(SteadyClock::now() + std::min(renewal_period(), kRenewalPatience));
    for (auto it = by_name.begin(); it != by_name.end();) {
      std::erase_if(it->second.holds, [&](const Renewal& renewal) {
        if (!demoted(renewals_, *renewal.state, it->first, renewal.server)) return false;
        renewal.state->lease->lose(primary_changed(renewal.server, renewals_.owner(keys_of(it->first).keys.front())));
        return true;
      });
      it = it->second.holds.empty() && it->second.queued.empty() ? by_name.erase(it) : std::next(it);
    }
  }
  if (by_name.empty() && orphans.empty()) return true;
  std::vector<ScriptCall> calls;
  for (auto& [name, entries] : by_name) {
    const auto keys = keys_of(name);
    std::vector<std::string> args{keys.channel, std::to_string(settings_.ttl.count())};
    for (auto& renewal : entries.holds) {
      args.push_back(renewal.seq);
      args.push_back(renewal.request);
    }
    for (auto& queued : entries.queued) {
      args.push_back(queued.seq);
      args.push_back(queued.request);
    }
    calls.emplace_back(&scripts::renew, keys.keys, std::move(args));
  }
  // Orphans ride in the same round trip, after the renewals.
  for (const auto& orphan : orphans) calls.emplace_back(orphan.script, orphan.keys, orphan.args);
  const auto sent_at = SteadyClock::now();
  std::vector<Result> results;
  try {
    results = renewals_.eval_each(calls, sent_at + std::min(renewal_period(), kRenewalPatience), stop);
  } catch (const std::exception&) {
    for (auto& [name, entries] : by_name) {
      for (auto& renewal : entries.holds) {
        if (!renewal.state->releasing) renewal.state->lease->unconfirmed("the renewal did not reach redis; its entry may still be alive");
      }
    }
    return false;  // orphans too are tried again then
  }
  bool settled = true;
  std::size_t at = 0;
  for (auto& [name, entries] : by_name) {
    const auto& result = results[at++];
    settled = settle_renewals(entries.holds, result, sent_at, result.server, entries.queued.size()) && settled;
    // A waiter whose entry is admitted (a message lost) or gone looks; one still waiting sleeps on.
    const auto* reply = result.ok() ? result.reply.get() : nullptr;
    if (!reply || reply->type != REDIS_REPLY_ARRAY || reply->elements != entries.holds.size() + entries.queued.size()) {
      settled = settled && entries.queued.empty();  // their leases too: the next round comes soon
      // A server answered, but not with their places (an error reply such as WRONGTYPE): each
      // waiter looks itself, and its look reports what the server says, as a new acquire's
      // would. A call no server answered pokes nobody: the waiters wait through an outage.
      if (result.ok() || !result.server.empty()) {
        for (const auto& queued : entries.queued) waiters_.poke_entry(queued.channel, queued.seq);
      }
      continue;
    }
    for (std::size_t i = 0; i < entries.queued.size(); ++i) {
      const auto* where = reply->element[entries.holds.size() + i];
      if (where->type == REDIS_REPLY_INTEGER && where->integer != 1) waiters_.poke_entry(entries.queued[i].channel, entries.queued[i].seq);
    }
  }
  if (!orphans.empty()) {
    std::set<std::uint64_t> answered;
    for (const auto& orphan : orphans) {
      if (!results[at++].ok()) continue;
      answered.insert(orphan.serial);
      for (const auto n : orphan.settles) request_ids_.settle(orphan.key, n);
    }
    std::lock_guard lock(holds_mutex_);
    std::erase_if(orphans_, [&](const Orphan& orphan) { return answered.count(orphan.serial) > 0; });
    settled = settled && orphans_.empty();
  }
  return settled;
}

bool RedisBackend::settle_renewals(const std::vector<Renewal>& holds, const Result& result, SteadyClock::time_point sent_at,
                                   const std::string& server, std::size_t queued) {
  // An error reply (OOM, READONLY, BUSY...) confirms nothing, and proves no loss either.
  std::string trouble = "redis answered the renewal unexpectedly";
  if (result.error) {
    try {
      std::rethrow_exception(result.error);
    } catch (const std::exception& error) {
      trouble = std::string("redis answered the renewal with an error: ") + error.what();
    }
  }
  const auto* reply = result.ok() ? result.reply.get() : nullptr;
  const bool usable = reply && reply->type == REDIS_REPLY_ARRAY && reply->elements == holds.size() + queued;
  bool settled = true;
  for (std::size_t i = 0; i < holds.size(); ++i) {
    // Read after the answer came: a release sent before the server ran this renewal set it
    // before sending, so a renewal that crossed a release is never taken for a loss.
    if (holds[i].state->releasing) continue;
    auto& lease = holds[i].state->lease;
    long long where = -1;
    if (usable && reply->element[i]->type == REDIS_REPLY_INTEGER) where = reply->element[i]->integer;
    if ((settings_.sentinel() || settings_.cluster()) && !server.empty() && holds[i].server != server) {
      // Renewed on another primary than the one that admitted it: its entry there may be a
      // replica's copy, or another's. Never carried over.
      lease->lose(primary_changed(holds[i].server, server));
    } else if (where == 2) {
      lease->confirmed(sent_at);
    } else if (where == 0 || where == 1) {
      // Gone, not ours, or no longer admitted: the server's state is not the one that
      // admitted us (evicted, deleted, restarted from an older snapshot).
      lease->lose("its entry expired or the redis server no longer has it as admitted (evicted, deleted, or "
                  "restarted without it)");
    } else {
      lease->unconfirmed(trouble);
      settled = false;
    }
  }
  return settled;
}

// The holder label an entry's text ends with, after the space that follows its since.
std::string label_after(std::istringstream& text) {
  std::string rest;
  std::getline(text, rest);
  return rest.size() > 1 && rest[0] == ' ' ? rest.substr(1) : std::string();
}

Inspection RedisBackend::inspect(const std::string& name, Deadline deadline) {
  const auto keys = keys_of(name);
  std::vector<ScriptCall> calls{{&scripts::inspect, keys.keys, {keys.channel}}};
  bool counter = true;
  try {
    const auto counter_keys_of_name = counter_keys(name, settings_.cluster());
    calls.emplace_back(&scripts::counter_inspect, counter_keys_of_name.keys,
                       std::vector<std::string>{counter_keys_of_name.channel});
  } catch (const InvalidArgument&) {
    counter = false;  // a lock name that no counter may use
  }
  auto until = SteadyClock::now() + kCallPatience;
  if (deadline) until = std::min(until, *deadline);
  auto replies = connection_.eval_pipelined(calls, until);
  for (const auto& reply : replies) {
    if (reply->type != REDIS_REPLY_ARRAY) unexpected_reply("inspect");
  }
  Inspection result;
  result.name = name;
  const auto* queue = replies[0].get();
  for (std::size_t i = 0; i < queue->elements; ++i) {
    const auto* item = queue->element[i];
    EntryInfo info;
    info.fencing_token = static_cast<std::uint64_t>(integer_at(item, 0));
    // "<kind><admitted> <permits> <limit> <request> <until ms> <pid> <host> <since ms>[ <label>]"
    std::istringstream text(string_at(item, 1));
    std::string state, request;
    std::int64_t limit = 0;
    long long until_ms = 0, since_ms = 0;
    text >> state >> info.permits >> limit >> request >> until_ms >> info.pid >> info.host >> since_ms;
    info.label = label_after(text);
    const char kind = state.empty() ? 'x' : state[0];
    info.kind = kind == 's' ? "shared" : kind == 'l' ? "lease" : "exclusive";
    info.holding = state.size() > 1 && state[1] == '1';
    info.since = std::chrono::system_clock::time_point(milliseconds(since_ms));
    if (i == 0) {
      result.mode = kind == 'l' ? "semaphore" : "lock";
      result.limit = kind == 'l' ? limit : 0;
    }
    (info.holding ? result.holders : result.waiters).push_back(info);
  }
  if (!counter) return result;
  const auto* permits = replies[1].get();
  if (permits->elements > 0 && permits->element[0]->type == REDIS_REPLY_STRING) {
    try {
      result.permits = std::stoll(string_at(permits, 0));
    } catch (const std::exception&) {
    }
  }
  for (std::size_t i = 1; i < permits->elements; ++i) {
    EntryInfo info;
    info.kind = "permits";
    info.fencing_token = static_cast<std::uint64_t>(integer_at(permits->element[i], 0));
    std::istringstream text(string_at(permits->element[i], 1));
    long long since_ms = 0;
    text >> info.pid >> info.host >> since_ms;
    info.label = label_after(text);
    info.since = std::chrono::system_clock::time_point(milliseconds(since_ms));
    result.waiters.push_back(info);
  }
  return result;
}

Reply RedisBackend::counter_change(const QueueKeys& keys, const Script& script,
                                   const std::function<std::vector<std::string>(const std::string&)>& args_with) {
  const auto& key = keys.keys.back();
  const auto n = request_ids_.open(key);
  const auto marked = request_ids_.marked(key, n);
  try {
    auto reply = connection_.eval(script, keys.keys, args_with(marked), SteadyClock::now() + kCallPatience, true);
    request_ids_.settle(key, n);
    return reply;
  } catch (const BackendUnavailable&) {
    retire_later({&scripts::counter_retire, keys.keys, {keys.channel, marked, "0"}, key, {n}, {}});
    throw;
  } catch (...) {
    request_ids_.settle(key, n);  // an error reply: nothing was changed
    throw;
  }
}

// Counter changes are applied at most once (see common_prelude.lua): the connection may resend
// one whose reply was lost, and a copy delivered after its sender settled or gave it up changes
// nothing.
bool RedisBackend::counter_try_set(const std::string& name, std::int64_t permits) {
  const auto keys = counter_keys(name, settings_.cluster());
  auto reply = counter_change(keys, scripts::counter_try_set, [&](const std::string& marked) {
    return std::vector<std::string>{keys.channel, std::to_string(permits), marked};
  });
  return integer_of(reply) == 1;
}

std::int64_t RedisBackend::counter_add(const std::string& name, std::int64_t delta) {
  const auto keys = counter_keys(name, settings_.cluster());
  auto reply = counter_change(keys, scripts::counter_add, [&](const std::string& marked) {
    return std::vector<std::string>{keys.channel, std::to_string(delta), marked, std::to_string(max_permits)};
  });
  if (integer_at(reply.get(), 0) == 0) {
    throw InvalidArgument("PermitCounter '" + name + "': adding " + std::to_string(delta) + " would take the count beyond ±" +
                          std::to_string(max_permits) + " (the count is " + redacted(settings_, string_at(reply.get(), 1)) +
                          "); nothing changed");
  }
  return integer_at(reply.get(), 1);
}

std::optional<std::int64_t> RedisBackend::counter_get(const std::string& name) {
  check_counter_name(name);
  auto reply = connection_.command({"GET", name}, SteadyClock::now() + kCallPatience, name);
  if (reply->type == REDIS_REPLY_NIL) return std::nullopt;
  try {
    if (reply->type == REDIS_REPLY_STRING) return std::stoll(std::string(reply->str, reply->len));
  } catch (const std::exception&) {
  }
  throw BackendUnavailable("the PermitCounter key '" + name + "' does not hold a number");
}

std::int64_t RedisBackend::counter_drain(const std::string& name) {
  const auto keys = counter_keys(name, settings_.cluster());
  return integer_of(counter_change(keys, scripts::counter_drain, [&](const std::string& marked) {
    return std::vector<std::string>{keys.channel, marked};
  }));
}
}  // namespace
}  // namespace turnstile::detail::redis

extern "C" std::unique_ptr<turnstile::detail::Backend> turnstile_backend_factory_v1(
    const turnstile::detail::BackendUrl& url, const turnstile::ClientOptions& options) {
  using namespace turnstile::detail::redis;
  auto own = url;
  const auto eviction = take_eviction_rule(own);
  return std::make_unique<RedisBackend>(parse_settings(own, options), eviction, options.error_handler,
                                        options.holder_label);
}