// The Redis backend: every state change is one Lua script (scripts/*.lua), so an uncontended
// acquire and a release are one round trip each. Everything one name needs lives in ONE hash
// (eviction or deletion takes all of it or nothing): a queue ordered by fencing tokens that
// keep growing even when that hash is lost (max(last + 1, server time in µs)), whose entries
// are leases renewed by a watchdog on its own connection every TTL/3 and reaped by the next
// script once they run out. Waiters sleep until a message names them, then ask the server: a
// message only wakes, the scripts alone admit. PermitCounter keeps Redisson's RSemaphore layout
// so Java and C++ share permits.
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "backends/redis/connection.hpp"
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
// NAME the tag. The two forms end differently, so "{x}" and "x" never share a line.
QueueKeys counter_keys(const std::string& name) {
  check_counter_name(name);
  const auto open = name.find('{');
  const auto close = open == std::string::npos ? std::string::npos : name.find('}', open + 1);
  const bool has_tag = close != std::string::npos && close > open + 1;
  const std::string line = has_tag ? name + ":turnstile:t" : "{" + name + "}:turnstile:c";
  const std::string channel = open != std::string::npos ? "redisson_sc:" + name : "redisson_sc:{" + name + "}";
  return {{name, line}, channel};
}

// Unique per client (drawn when the client connects, so forked processes differ) and per call.
class RequestIds {
 public:
  RequestIds() {
    std::random_device random;
    std::snprintf(prefix_, sizeof prefix_, "%08x%08x%08x", random(), random(), random());
  }
  std::string next() { return prefix_ + std::string(":") + std::to_string(++count_); }

 private:
  char prefix_[25];
  std::atomic<std::uint64_t> count_{0};
};

std::string host_name() {
  char buffer[256] = {};
  gethostname(buffer, sizeof buffer - 1);
  return buffer;
}

// A script's reply: an array whose element `index` is an integer (or decimal text).
long long integer_at(const redisReply* reply, std::size_t index) {
  if (!reply || reply->type != REDIS_REPLY_ARRAY || reply->elements <= index) {
    throw BackendUnavailable("redis answered a script with an unexpected reply");
  }
  const auto* element = reply->element[index];
  if (element->type == REDIS_REPLY_INTEGER) return element->integer;
  if (element->type == REDIS_REPLY_STRING) {
    try {
      return std::stoll(std::string(element->str, element->len));
    } catch (const std::exception&) {
    }
  }
  throw BackendUnavailable("redis answered a script with an unexpected reply");
}

// Fencing tokens and places in line stay below 2^53 (the scripts refuse to hand out more), so
// Lua's doubles carry them exactly; anything else in a reply is not a token.
constexpr long long kMaxToken = (1LL << 53) - 1;

std::uint64_t token_at(const redisReply* reply, std::size_t index) {
  const auto value = integer_at(reply, index);
  if (value < 1 || value > kMaxToken) {
    throw BackendUnavailable("redis answered a script with an impossible fencing token " + std::to_string(value));
  }
  return static_cast<std::uint64_t>(value);
}

std::string string_at(const redisReply* reply, std::size_t index) {
  if (!reply || reply->type != REDIS_REPLY_ARRAY || reply->elements <= index) return {};
  const auto* element = reply->element[index];
  return element->str ? std::string(element->str, element->len) : std::string();
}

long long integer_of(const Reply& reply) {
  if (reply->type != REDIS_REPLY_INTEGER) throw BackendUnavailable("redis answered a script with an unexpected reply");
  return reply->integer;
}

char kind_code(EntryKind kind) {
  switch (kind) {
    case EntryKind::exclusive: return 'x';
    case EntryKind::shared: return 's';
    case EntryKind::lease: return 'l';
  }
  return 'x';
}

// What the backend reads from the URL beyond Settings: ?eviction=warn|refuse (what to do when
// the server may evict lock state). Taken out before parse_settings, which knows only ttl.
struct EvictionRule {
  bool refuse = false;
};

EvictionRule take_eviction_rule(BackendUrl& url) {
  EvictionRule rule;
  if (const auto it = url.query.find("eviction"); it != url.query.end()) {
    if (it->second != "warn" && it->second != "refuse") {
      throw InvalidUrl("bad eviction=" + it->second + " in '" + url.text + "' (expected warn or refuse)");
    }
    rule.refuse = it->second == "refuse";
    url.query.erase(it);
  }
  return rule;
}

class RedisBackend;

// How long a release waits for the server (see RedisHold::release and the README).
constexpr milliseconds kReleasePatience{1000};
constexpr milliseconds kLostReleasePatience{250};

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
  RedisHold(RedisBackend& backend, std::string name, std::uint64_t seq, std::string request,
            std::shared_ptr<LossSignal> loss, std::shared_ptr<ServerLease> lease);
  ~RedisHold() override;

  std::uint64_t fencing_token() const override { return seq_; }
  void downgrade() override;
  void release() override;

  const std::string& name() const { return name_; }
  std::uint64_t seq() const { return seq_; }
  const std::string& request() const { return request_; }
  const std::shared_ptr<HoldLease>& state() const { return state_; }

 private:
  RedisBackend& backend_;
  std::string name_;
  std::uint64_t seq_;
  std::string request_;  // the acquire's request id: the entry's owner
  std::shared_ptr<LossSignal> loss_;
  std::shared_ptr<ServerLease> lease_;
  std::shared_ptr<HoldLease> state_;
  bool released_ = false;
  std::uint64_t fork_generation_ = fork_generation();  // a child's copy touches nothing
};

class RedisBackend final : public Backend {
 public:
  RedisBackend(Settings settings, EvictionRule eviction, ErrorHandler warn)
      : settings_(settings),
        identity_(std::to_string(getpid()) + " " + host_name()),
        wake_fd_(make_wake_fd()),
        connection_(settings, all_scripts(), [this] { renew_soon(); }),
        renewals_(settings, all_scripts(), [this] { renew_soon(); }, renewal_retry()),
        subscriber_(settings, [this](const std::string& channel, const std::string& payload) { on_message(channel, payload); },
                    [this] { on_subscriber_reset(); }) {
    check_eviction_policy(eviction, warn);
    watchdog_ = std::jthread([this](std::stop_token stop) { watchdog_loop(stop); });
  }

  ~RedisBackend() override {
    watchdog_.request_stop();
    renew_soon();  // wakes the watchdog
    // jthread members join next; the eventfd outlives them (declared first).
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
  const Settings& settings() const { return settings_; }
  QueueKeys keys_of(const std::string& name) const { return queue_keys(name, settings_.db); }
  // How long a release is remembered, so a resend after a lost reply is recognised.
  std::string release_memory_ms() const {
    return std::to_string(std::max<long long>(2 * settings_.ttl.count(), 60'000));
  }
  void track(RedisHold* hold) {
    std::lock_guard lock(holds_mutex_);
    holds_.insert(hold);
  }
  void untrack(RedisHold* hold) {
    std::lock_guard lock(holds_mutex_);
    holds_.erase(hold);
  }

 private:
  // One waiter in this process. A message only wakes it: it then asks the server.
  struct Waiter {
    std::string seq;         // queue waiters: our entry, "" until the acquire reply came
    std::uint64_t place = 0; // counter waiters: our place in line, 0 until known
    bool poked = false;
  };

  milliseconds recheck_interval() const { return std::min(milliseconds(2000), settings_.ttl / 3); }
  milliseconds renewal_period() const { return std::max(milliseconds(100), settings_.ttl / 3); }
  // How soon a renewal round that got no answer is tried again; also the renewal connection's
  // longest reconnect backoff, so a server back after a restart is found within it.
  milliseconds renewal_retry() const { return std::min(renewal_period(), milliseconds(250)); }
  static int make_wake_fd() {
    const int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fd < 0) throw BackendUnavailable("eventfd failed");
    return fd;
  }
  void check_eviction_policy(const EvictionRule& rule, const ErrorHandler& warn);
  void on_message(const std::string& channel, const std::string& payload);
  void on_subscriber_reset();
  void renew_soon();
  void watchdog_loop(std::stop_token stop);
  void poke(Waiter& waiter);
  // Sleeps until the waiter is poked, the re-check interval passes, or the deadline.
  void sleep_as(Waiter& waiter, Deadline deadline);
  // Takes the entry of `request` out of the queue (by seq when known), bounded; when that
  // fails, the watchdog keeps trying (an entry left behind would hold the name up for a TTL).
  void leave(const std::string& name, const std::string& seq, const std::string& request) noexcept;
  // Counters: the local waiter first in line looks again; every waiter not yet placed too.
  void poke_counter_head(const std::string& channel, std::uint64_t head);

  Settings settings_;
  std::string identity_;  // "<pid> <host>", for inspect
  // Wakes the watchdog (renew now, or stop). Closed last, after every thread that uses it.
  struct WakeFd {
    int fd;
    ~WakeFd() { close(fd); }
  } wake_fd_;
  RequestIds request_ids_;
  LossClock loss_clock_;  // before every hold's lease
  Connection connection_;
  Connection renewals_;  // the watchdog's own: renewals never queue behind other calls

  std::mutex waiters_mutex_;
  std::condition_variable waiters_cv_;
  std::map<std::string, std::set<Waiter*>> queue_waiters_;    // channel -> waiters
  std::map<std::string, std::set<Waiter*>> counter_waiters_;  // channel -> waiters

  // Entries whose removal failed (or whose creation's outcome is unknown), until removed.
  struct Orphan {
    std::string name, seq, request;
    SteadyClock::time_point give_up;  // it has expired on the server by then
  };

  std::mutex holds_mutex_;
  std::set<RedisHold*> holds_;
  std::vector<Orphan> orphans_;

  Subscriber subscriber_;  // after the waiter tables: its thread calls into them
  std::jthread watchdog_;  // last: stopped and joined first
};

RedisHold::RedisHold(RedisBackend& backend, std::string name, std::uint64_t seq, std::string request,
                     std::shared_ptr<LossSignal> loss, std::shared_ptr<ServerLease> lease)
    : backend_(backend), name_(std::move(name)), seq_(seq), request_(std::move(request)), loss_(std::move(loss)),
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
}

void RedisHold::downgrade() {
  const auto keys = backend_.keys_of(name_);
  auto reply = backend_.connection().eval(scripts::downgrade, keys.keys, {keys.channel, std::to_string(seq_), request_},
                                          SteadyClock::now() + milliseconds(5000), true);
  if (integer_of(reply) == 0) lease_->lose("its entry expired or the redis server forgot it");
}

void RedisHold::release() {
  if (released_) return;
  const auto keys = backend_.keys_of(name_);
  // Bounded: at most kReleasePatience, and no longer once the hold is reported lost (a hold
  // already lost gets one short try): the caller must hear of a loss at once, and the core
  // retries a failed release in the background. A resend after a lost reply finds the release
  // remembered, not a loss.
  const bool lost = loss_->lost();
  const auto patience = lost ? kLostReleasePatience : kReleasePatience;
  // From now on a renewal that finds the entry gone may have crossed this release: only the
  // release's own answer says whether the hold was lost.
  state_->releasing = true;
  auto reply = backend_.connection().eval(scripts::release, keys.keys,
                                          {keys.channel, std::to_string(seq_), request_, backend_.release_memory_ms()},
                                          SteadyClock::now() + patience, true, nullptr,
                                          lost ? std::stop_token() : loss_->token());
  released_ = true;
  backend_.untrack(this);
  if (integer_of(reply) == 0) {
    lease_->lose("its entry had expired or the redis server forgot it before the release");
  } else {
    lease_->detach(loss_.get());
  }
}

void RedisBackend::check_eviction_policy(const EvictionRule& rule, const ErrorHandler& warn) {
  Reply reply;
  try {
    reply = connection_.command({"CONFIG", "GET", "maxmemory-policy"}, SteadyClock::now() + milliseconds(2000));
  } catch (const AccessDenied&) {
    return;  // CONFIG not allowed to this user (or renamed away): nothing to check
  } catch (const BackendUnavailable&) {
    return;
  }
  if (!reply || reply->type != REDIS_REPLY_ARRAY || reply->elements < 2) return;
  const auto policy = string_at(reply.get(), 1);
  if (policy.rfind("allkeys-", 0) != 0) return;
  const std::string what = "redis at " + settings_.description + " has maxmemory-policy " + policy +
                           ": it may evict lock state while it is held (the holder is then told its hold is lost, "
                           "and fencing tokens keep growing); use noeviction or volatile-*";
  if (rule.refuse) throw BackendUnavailable(what + " (refused: eviction=refuse)");
  const BackendUnavailable warning("warning: " + what);
  if (warn) {
    try {
      warn(warning);
    } catch (...) {
    }
  } else {
    std::fprintf(stderr, "turnstile: %s\n", warning.what());
  }
}

void RedisBackend::poke(Waiter& waiter) { waiter.poked = true; }

void RedisBackend::on_message(const std::string& channel, const std::string& payload) {
  std::lock_guard lock(waiters_mutex_);
  if (const auto queue = queue_waiters_.find(channel); queue != queue_waiters_.end()) {
    std::set<std::string> named;
    std::istringstream seqs(payload);
    for (std::string seq; seqs >> seq;) named.insert(seq);
    // A waiter still reading its acquire reply does not know its seq yet: it looks too.
    for (auto* waiter : queue->second) {
      if (waiter->seq.empty() || named.count(waiter->seq)) poke(*waiter);
    }
  }
  if (const auto counter = counter_waiters_.find(channel); counter != counter_waiters_.end()) {
    Waiter* first = nullptr;
    for (auto* waiter : counter->second) {
      if (waiter->place == 0) poke(*waiter);
      else if (!first || waiter->place < first->place) first = waiter;
    }
    if (first) poke(*first);
  }
  waiters_cv_.notify_all();
}

void RedisBackend::poke_counter_head(const std::string& channel, std::uint64_t head) {
  std::lock_guard lock(waiters_mutex_);
  if (const auto counter = counter_waiters_.find(channel); counter != counter_waiters_.end()) {
    for (auto* waiter : counter->second) {
      if (waiter->place == head) poke(*waiter);
    }
  }
  waiters_cv_.notify_all();
}

void RedisBackend::on_subscriber_reset() {
  {
    std::lock_guard lock(waiters_mutex_);
    for (auto& [channel, waiters] : queue_waiters_) {
      for (auto* waiter : waiters) poke(*waiter);
    }
    for (auto& [channel, waiters] : counter_waiters_) {
      for (auto* waiter : waiters) poke(*waiter);
    }
    waiters_cv_.notify_all();
  }
  // The subscriber lost its connection and made a new one: the server may have restarted
  // without the holds' entries. One renewal round finds out.
  renew_soon();
}

void RedisBackend::sleep_as(Waiter& waiter, Deadline deadline) {
  auto until = SteadyClock::now() + recheck_interval();
  if (deadline) until = std::min(until, *deadline);
  std::unique_lock lock(waiters_mutex_);
  waiters_cv_.wait_until(lock, until, [&] { return waiter.poked; });
}

void RedisBackend::leave(const std::string& name, const std::string& seq, const std::string& request) noexcept {
  try {
    const auto keys = keys_of(name);
    auto reply = connection_.eval(scripts::release, keys.keys, {keys.channel, seq, request, release_memory_ms()},
                                  SteadyClock::now() + milliseconds(1000), true);
    integer_of(reply);
    return;
  } catch (...) {
  }
  try {
    {
      std::lock_guard lock(holds_mutex_);
      orphans_.push_back({name, seq, request, SteadyClock::now() + settings_.ttl + milliseconds(5000)});
    }
    renew_soon();
  } catch (...) {
  }
}

std::unique_ptr<BackendHold> RedisBackend::acquire(const QueueRequest& request, Deadline deadline,
                                                   std::shared_ptr<LossSignal> loss) {
  const auto keys = keys_of(request.name);
  const bool try_once = deadline && *deadline <= SteadyClock::now();
  // One request id for every entry this call makes: whatever its seq, a release by request id
  // finds it (an entry whose reply was lost, or the fresh one of a waiter that lost its place).
  const auto request_id = request_ids_.next();
  // Registered before the acquire script runs, so a message published between its reply and
  // our reading it still wakes us (to look: it proves nothing by itself).
  Waiter waiter;
  struct Registration {
    RedisBackend& backend;
    const std::string& channel;
    Waiter& waiter;
    bool subscribed = false;
    Registration(RedisBackend& b, const std::string& c, Waiter& w) : backend(b), channel(c), waiter(w) {
      std::lock_guard lock(backend.waiters_mutex_);
      backend.queue_waiters_[channel].insert(&waiter);
    }
    ~Registration() {
      {
        std::lock_guard lock(backend.waiters_mutex_);
        auto& waiters = backend.queue_waiters_[channel];
        waiters.erase(&waiter);
        if (waiters.empty()) backend.queue_waiters_.erase(channel);
      }
      if (subscribed) backend.subscriber_.unsubscribe(channel);
    }
  };
  std::optional<Registration> registration;
  if (!try_once) registration.emplace(*this, keys.channel, waiter);
  const bool was_listening = !try_once && subscriber_.listening(keys.channel);
  const auto stopped = [&] { return request.stop.stop_requested(); };
  auto sent_at = SteadyClock::now();
  // Joins the queue at its back; every wait of the call ends at once on a stop. Returns the
  // status (1 admitted, 2 waiting; 0 not admitted on a try-once) and sets `seq`.
  std::uint64_t seq = 0;
  const auto join = [&] {
    sent_at = SteadyClock::now();
    auto reply = connection_.eval(scripts::acquire, keys.keys,
                                  {keys.channel, std::string(1, kind_code(request.kind)), std::to_string(request.permits),
                                   std::to_string(request.limit), std::to_string(settings_.ttl.count()),
                                   try_once ? "1" : "0", request_id, identity_},
                                  deadline, true, nullptr, request.stop);
    const auto status = integer_at(reply.get(), 0);
    if (status == -1) check_queue_mode(request, string_at(reply.get(), 1) == "lock" ? QueueMode::lock : QueueMode::semaphore, 0);
    if (status == -2) check_queue_mode(request, QueueMode::semaphore, integer_at(reply.get(), 1));
    if (status == 0) return status;
    if (status != 1 && status != 2) throw BackendUnavailable("redis answered acquire with status " + std::to_string(status));
    seq = token_at(reply.get(), 1);
    return status;
  };
  const auto admitted = [&] {
    return std::make_unique<RedisHold>(*this, request.name, seq, request_id, std::move(loss),
                                       loss_clock_.watch(settings_.ttl, sent_at));
  };
  long long status;
  try {
    status = join();
  } catch (const BackendUnavailable&) {
    // The script may have run and its reply been lost: take out the entry it may have made
    // (found by our request id) rather than leave it to hold up the name for a TTL.
    leave(request.name, "", request_id);
    if (stopped()) return nullptr;
    throw;
  }
  if (status == 0) return nullptr;
  if (status == 1) return admitted();

  // Waiting in line: woken by a message naming us (or a stop, or the subscriber reconnecting),
  // we ask the server where we stand; we also ask now and then, so no lost message strands us.
  std::string seq_text = std::to_string(seq);  // "" while unknown
  const auto set_seq = [&](const std::string& text) {
    std::lock_guard lock(waiters_mutex_);
    waiter.seq = text;  // "": every message on the channel wakes us
  };
  set_seq(seq_text);
  std::stop_callback on_stop(request.stop, [&] {
    std::lock_guard lock(waiters_mutex_);
    poke(waiter);
    waiters_cv_.notify_all();
  });
  auto confirm_until = SteadyClock::now() + milliseconds(1000);
  if (deadline) confirm_until = std::min(confirm_until, *deadline);
  subscriber_.subscribe(keys.channel, confirm_until, request.stop);
  registration->subscribed = true;
  // Subscribed before the acquire script ran: every message since reached us. Otherwise one
  // look now covers a message published before the subscription took.
  bool look = !was_listening;
  try {
    for (;;) {
      {
        std::lock_guard lock(waiters_mutex_);
        look = look || waiter.poked;
        waiter.poked = false;
      }
      if (stopped()) {
        leave(request.name, seq_text, request_id);
        return nullptr;
      }
      if (look) {
        sent_at = SteadyClock::now();
        auto state = connection_.eval(scripts::renew, keys.keys,
                                      {keys.channel, std::to_string(settings_.ttl.count()), seq_text, request_id},
                                      deadline, true, nullptr, request.stop);
        const auto where = integer_at(state.get(), 0);
        if (where == 2) break;
        if (where == 0) {
          // Our entry is gone (we were paused past the TTL, or the server lost the name's
          // state): nothing was held, so we queue again, at the back, as a newcomer would.
          if (deadline && *deadline <= SteadyClock::now()) return nullptr;
          seq_text.clear();
          set_seq(seq_text);
          if (join() == 1) return admitted();
          seq_text = std::to_string(seq);
          set_seq(seq_text);  // a message meanwhile woke us (seq ""): poked, we look
          look = false;
          continue;
        }
      }
      look = true;  // every wake-up, and every re-check interval, asks the server
      if (deadline && *deadline <= SteadyClock::now()) {
        leave(request.name, seq_text, request_id);
        return nullptr;
      }
      sleep_as(waiter, deadline);
    }
  } catch (...) {
    leave(request.name, seq_text, request_id);
    if (stopped()) return nullptr;
    throw;
  }
  return admitted();
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
// same round trips until done.
void RedisBackend::watchdog_loop(std::stop_token stop) {
  const auto period = renewal_period();
  const auto retry = renewal_retry();
  const auto patience = std::min(period, milliseconds(1000));
  auto wait = period;
  while (!stop.stop_requested()) {
    const auto until = SteadyClock::now() + wait;
    while (!stop.stop_requested() && SteadyClock::now() < until) {
      if (renewals_.watch_idle(until, wake_fd_.fd)) break;  // the server went away: look now
      std::uint64_t count;
      if (read(wake_fd_.fd, &count, sizeof count) > 0) break;  // renew_soon(), or stop
    }
    wait = period;
    if (stop.stop_requested()) break;
    // A snapshot (leases are shared: a hold may be released and destroyed meanwhile).
    struct Renewal {
      std::shared_ptr<HoldLease> state;
      std::string seq, request;
    };
    std::map<std::string, std::vector<Renewal>> by_name;
    std::vector<Orphan> orphans;
    {
      std::lock_guard lock(holds_mutex_);
      for (auto* hold : holds_) {
        // A hold being released is still renewed (a release that failed is retried later and
        // its entry must not expire under it meanwhile), but its answers are ignored below.
        if (!hold->state()->lease->lost()) {
          by_name[hold->name()].push_back({hold->state(), std::to_string(hold->seq()), hold->request()});
        }
      }
      const auto now = SteadyClock::now();
      std::erase_if(orphans_, [&](const Orphan& orphan) { return orphan.give_up <= now; });
      orphans = orphans_;
    }
    if (by_name.empty() && orphans.empty()) continue;
    std::vector<ScriptCall> calls;
    std::vector<std::vector<std::shared_ptr<HoldLease>>> groups;
    for (auto& [name, holds] : by_name) {
      const auto keys = keys_of(name);
      std::vector<std::string> args{keys.channel, std::to_string(settings_.ttl.count())};
      groups.emplace_back();
      for (auto& renewal : holds) {
        args.push_back(renewal.seq);
        args.push_back(renewal.request);
        groups.back().push_back(renewal.state);
      }
      calls.emplace_back(&scripts::renew, keys.keys, std::move(args));
    }
    // Orphans ride in the same round trip, after the renewals.
    for (const auto& orphan : orphans) {
      const auto keys = keys_of(orphan.name);
      calls.emplace_back(&scripts::release, keys.keys,
                         std::vector<std::string>{keys.channel, orphan.seq, orphan.request, release_memory_ms()});
    }
    const auto sent_at = SteadyClock::now();
    std::vector<Result> results;
    try {
      results = renewals_.eval_each(calls, sent_at + patience);
    } catch (const std::exception&) {
      for (auto& group : groups) {
        for (auto& state : group) {
          if (!state->releasing) state->lease->unconfirmed("the renewal did not reach redis; its entry may still be alive");
        }
      }
      wait = retry;  // orphans too are tried again then
      continue;
    }
    if (!orphans.empty()) {
      std::set<std::string> removed;
      for (std::size_t i = 0; i < orphans.size(); ++i) {
        const auto at = groups.size() + i;
        if (at < results.size() && results[at].ok()) removed.insert(orphans[i].request);
      }
      std::lock_guard lock(holds_mutex_);
      std::erase_if(orphans_, [&](const Orphan& orphan) { return removed.count(orphan.request) > 0; });
      if (!orphans_.empty()) wait = retry;
    }
    for (std::size_t g = 0; g < groups.size(); ++g) {
      // An error reply (OOM, READONLY, BUSY...) confirms nothing, and proves no loss either.
      std::string trouble = "redis answered the renewal unexpectedly";
      const redisReply* reply = nullptr;
      if (g < results.size() && results[g].ok()) {
        reply = results[g].reply.get();
      } else if (g < results.size()) {
        try {
          std::rethrow_exception(results[g].error);
        } catch (const std::exception& error) {
          trouble = std::string("redis answered the renewal with an error: ") + error.what();
        }
      }
      const bool usable = reply && reply->type == REDIS_REPLY_ARRAY && reply->elements == groups[g].size();
      for (std::size_t i = 0; i < groups[g].size(); ++i) {
        // Read after the answer came: a release sent before the server ran this renewal set
        // it before sending, so a renewal that crossed a release is never taken for a loss.
        if (groups[g][i]->releasing) continue;
        auto& lease = groups[g][i]->lease;
        long long where = -1;
        if (usable) {
          try {
            where = integer_at(reply, i);
          } catch (const Error&) {
          }
        }
        if (where == 2) {
          lease->confirmed(sent_at);
        } else if (where == 0 || where == 1) {
          // Gone, not ours, or no longer admitted: the server's state is not the one that
          // admitted us (evicted, deleted, restarted from an older snapshot).
          lease->lose("its entry expired or the redis server no longer has it as admitted (evicted, deleted, or "
                      "restarted without it)");
        } else {
          lease->unconfirmed(trouble);
          wait = retry;
        }
      }
    }
  }
}

Inspection RedisBackend::inspect(const std::string& name) {
  const auto keys = keys_of(name);
  std::vector<ScriptCall> calls{{&scripts::inspect, keys.keys, {keys.channel}}};
  bool counter = true;
  try {
    const auto counter_keys_of_name = counter_keys(name);
    calls.emplace_back(&scripts::counter_inspect, counter_keys_of_name.keys,
                       std::vector<std::string>{counter_keys_of_name.channel});
  } catch (const InvalidArgument&) {
    counter = false;  // a lock name that no counter may use
  }
  auto replies = connection_.eval_pipelined(calls, SteadyClock::now() + milliseconds(5000));
  for (const auto& reply : replies) {
    if (reply->type == REDIS_REPLY_ERROR) throw BackendUnavailable("redis inspect failed: " + std::string(reply->str, reply->len));
    if (reply->type != REDIS_REPLY_ARRAY) throw BackendUnavailable("redis answered inspect unexpectedly");
  }
  Inspection result;
  result.name = name;
  const auto* queue = replies[0].get();
  for (std::size_t i = 0; i < queue->elements; ++i) {
    const auto* item = queue->element[i];
    EntryInfo info;
    info.fencing_token = static_cast<std::uint64_t>(integer_at(item, 0));
    // "<kind><admitted> <permits> <limit> <request> <until ms> <pid> <host> <since ms>"
    std::istringstream text(string_at(item, 1));
    std::string state, request;
    std::int64_t limit = 0;
    long long until_ms = 0, since_ms = 0;
    text >> state >> info.permits >> limit >> request >> until_ms >> info.pid >> info.host >> since_ms;
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
    info.since = std::chrono::system_clock::time_point(milliseconds(since_ms));
    result.waiters.push_back(info);
  }
  return result;
}

// Counter changes carry a request id: the scripts remember what each did, so the connection may
// resend one whose reply was lost without applying it twice.
bool RedisBackend::counter_try_set(const std::string& name, std::int64_t permits) {
  const auto keys = counter_keys(name);
  auto reply = connection_.eval(scripts::counter_try_set, keys.keys, {keys.channel, std::to_string(permits), request_ids_.next()},
                                SteadyClock::now() + milliseconds(5000), true);
  return integer_of(reply) == 1;
}

std::int64_t RedisBackend::counter_add(const std::string& name, std::int64_t delta) {
  const auto keys = counter_keys(name);
  try {
    auto reply = connection_.eval(scripts::counter_add, keys.keys,
                                  {keys.channel, std::to_string(delta), request_ids_.next(), std::to_string(max_permits)},
                                  SteadyClock::now() + milliseconds(5000), true);
    return integer_of(reply);
  } catch (const BackendUnavailable& error) {
    const std::string what = error.what();
    if (const auto at = what.find("RANGE "); at != std::string::npos) {
      throw InvalidArgument("PermitCounter '" + name + "': adding " + std::to_string(delta) + " would take the count beyond ±" +
                            std::to_string(max_permits) + " (" + what.substr(at + 6) + "); nothing changed");
    }
    throw;
  }
}

std::optional<std::int64_t> RedisBackend::counter_get(const std::string& name) {
  check_counter_name(name);
  auto reply = connection_.command({"GET", name}, SteadyClock::now() + milliseconds(5000));
  if (reply->type == REDIS_REPLY_NIL) return std::nullopt;
  try {
    if (reply->type == REDIS_REPLY_STRING) return std::stoll(std::string(reply->str, reply->len));
  } catch (const std::exception&) {
  }
  throw BackendUnavailable("the PermitCounter key '" + name + "' does not hold a number");
}

std::int64_t RedisBackend::counter_drain(const std::string& name) {
  const auto keys = counter_keys(name);
  auto reply = connection_.eval(scripts::counter_drain, keys.keys, {keys.channel, request_ids_.next()},
                                SteadyClock::now() + milliseconds(5000), true);
  return integer_of(reply);
}

bool RedisBackend::counter_acquire(const std::string& name, std::int64_t permits, Deadline deadline) {
  const auto keys = counter_keys(name);
  // One request id for every look of this call: a resend finds our place, or learns that the
  // permits were taken already.
  const auto request_id = request_ids_.next();
  const auto look = [&](const char* mode, Deadline until) {
    return connection_.eval(scripts::counter_acquire, keys.keys,
                            {keys.channel, std::to_string(permits), std::to_string(settings_.ttl.count()), mode, identity_,
                             request_id},
                            until, true);
  };
  Waiter waiter;
  {
    std::lock_guard lock(waiters_mutex_);
    counter_waiters_[keys.channel].insert(&waiter);
  }
  bool subscribed = false;
  const auto unregister = [&] {
    {
      std::lock_guard lock(waiters_mutex_);
      auto& line = counter_waiters_[keys.channel];
      line.erase(&waiter);
      if (line.empty()) counter_waiters_.erase(keys.channel);
    }
    if (subscribed) subscriber_.unsubscribe(keys.channel);
  };
  try {
    for (;;) {
      const bool last_try = deadline && *deadline <= SteadyClock::now();
      {
        std::lock_guard lock(waiters_mutex_);
        waiter.poked = false;
      }
      // The last try still gets a second to be answered.
      auto reply = look(last_try ? "1" : "0", deadline ? std::max(*deadline, SteadyClock::now() + milliseconds(1000)) : deadline);
      const auto status = integer_at(reply.get(), 0);
      if (status == 1 || status == 0) {
        unregister();
        return status == 1;
      }
      const auto place = static_cast<std::uint64_t>(integer_at(reply.get(), 1));
      const auto head = static_cast<std::uint64_t>(integer_at(reply.get(), 2));
      {
        std::lock_guard lock(waiters_mutex_);
        waiter.place = place;
      }
      // The message that woke us may have been meant for the first in line: if that is one of
      // ours, it looks now rather than at its next re-check.
      if (head != place) poke_counter_head(keys.channel, head);
      if (!subscribed) {
        auto confirm_until = SteadyClock::now() + milliseconds(1000);
        if (deadline) confirm_until = std::min(confirm_until, *deadline);
        subscriber_.subscribe(keys.channel, confirm_until);
        subscribed = true;
        continue;  // look once more now that no release can go unheard
      }
      sleep_as(waiter, deadline);
    }
  } catch (const BackendUnavailable&) {
    // Leave the line, bounded; if the lost reply had taken the permits, say so instead.
    try {
      auto reply = look("2", SteadyClock::now() + milliseconds(1000));
      if (integer_at(reply.get(), 0) == 1) {
        unregister();
        return true;
      }
    } catch (...) {
    }
    unregister();
    throw;
  } catch (...) {
    unregister();
    throw;
  }
}

}  // namespace
}  // namespace turnstile::detail::redis

extern "C" std::unique_ptr<turnstile::detail::Backend> turnstile_backend_factory_v1(
    const turnstile::detail::BackendUrl& url, const turnstile::ClientOptions& options) {
  using namespace turnstile::detail::redis;
  auto own = url;
  const auto eviction = take_eviction_rule(own);
  return std::make_unique<RedisBackend>(parse_settings(own, options), eviction, options.error_handler);
}
