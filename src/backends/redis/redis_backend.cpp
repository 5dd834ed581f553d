// The Redis backend: every state change is one Lua script (scripts/*.lua), so an uncontended
// acquire and a release are one round trip each. Queue primitives keep a per-name queue
// ordered by a per-name INCR counter, which is also the fencing token; entries are leases
// renewed by a watchdog every TTL/3 and reaped by the next script once they run out. Waiters
// sleep until a release script publishes their sequence number, and look again on a bounded
// interval so that a lost message never strands them. PermitCounter keeps Redisson's
// RSemaphore layout so Java and C++ share permits.
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "backends/redis/connection.hpp"
#include "backends/redis/scripts.hpp"
#include "backends/redis/subscriber.hpp"

namespace turnstile::detail::redis {
namespace {

using std::chrono::milliseconds;

// A name's keys share one hash tag, so a Redis Cluster keeps them in one slot. The tag is
// the name with '{', '}' and '%' percent-encoded: any name, braces included, stays whole.
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
  std::vector<std::string> keys;  // as the queue scripts number them
  std::string channel;
};

QueueKeys queue_keys(const std::string& name) {
  const auto tag = queue_tag(name);
  return {{tag + "seq", tag + "q", tag + "e", tag + "x", tag + "r"}, tag + "w"};
}

// Redisson's RSemaphore: the permit count is the plain key NAME, releases go to
// "redisson_sc:{NAME}" (RedissonSemaphore.getChannelName). turnstile's waiter line must sit
// in NAME's cluster slot: reuse NAME's own hash tag, or make NAME the tag.
QueueKeys counter_keys(const std::string& name) {
  const auto open = name.find('{');
  const auto close = open == std::string::npos ? std::string::npos : name.find('}', open + 1);
  const bool has_tag = close != std::string::npos && close > open + 1;
  const std::string tag = (has_tag ? name : "{" + name + "}") + ":turnstile:";
  return {{name, tag + "waiters", tag + "expiries", tag + "seq", tag + "info"}, "redisson_sc:{" + name + "}"};
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

long long integer_at(const redisReply* reply, std::size_t index) {
  if (!reply || reply->type != REDIS_REPLY_ARRAY || reply->elements <= index) {
    throw BackendUnavailable("redis answered a script with an unexpected reply");
  }
  const auto* element = reply->element[index];
  if (element->type == REDIS_REPLY_INTEGER) return element->integer;
  if (element->type == REDIS_REPLY_STRING) return std::stoll(std::string(element->str, element->len));
  throw BackendUnavailable("redis answered a script with an unexpected reply");
}

std::string string_at(const redisReply* reply, std::size_t index) {
  const auto* element = reply->element[index];
  return element->str ? std::string(element->str, element->len) : std::string();
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

class RedisHold final : public BackendHold {
 public:
  RedisHold(RedisBackend& backend, std::string name, std::uint64_t seq, std::shared_ptr<LossSignal> loss,
            std::uint64_t server_generation, SteadyClock::time_point renewed_at);
  ~RedisHold() override;

  std::uint64_t fencing_token() const override { return seq_; }
  void downgrade() override;
  void release() override;

  const std::string& name() const { return name_; }
  std::uint64_t seq() const { return seq_; }
  LossSignal& loss() { return *loss_; }
  const std::shared_ptr<LossSignal>& loss_signal() const { return loss_; }
  std::uint64_t server_generation() const { return server_generation_; }
  // The send time of the last renewal the server confirmed: the lease lasts at least TTL from it.
  SteadyClock::time_point renewed_at() const { return renewed_at_.load(); }
  void set_renewed_at(SteadyClock::time_point when) { renewed_at_.store(when); }

 private:
  RedisBackend& backend_;
  std::string name_;
  std::uint64_t seq_;
  std::shared_ptr<LossSignal> loss_;
  std::uint64_t server_generation_;
  std::atomic<SteadyClock::time_point> renewed_at_;
  bool released_ = false;
};

class RedisBackend final : public Backend {
 public:
  RedisBackend(Settings settings)
      : settings_(settings),
        identity_(std::to_string(getpid()) + " " + host_name()),
        connection_(settings, all_scripts(), [this] { watchdog_cv_.notify_all(); }),
        subscriber_(settings, [this](const std::string& channel, const std::string& payload) { on_message(channel, payload); },
                    [this] { on_subscriber_reset(); }) {
    watchdog_ = std::jthread([this](std::stop_token stop) { watchdog_loop(stop); });
  }

  ~RedisBackend() override {
    watchdog_.request_stop();
    watchdog_cv_.notify_all();
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
  void track(RedisHold* hold) {
    std::lock_guard lock(holds_mutex_);
    holds_.insert(hold);
  }
  void untrack(RedisHold* hold) {
    std::lock_guard lock(holds_mutex_);
    holds_.erase(hold);
  }

 private:
  // One waiter in this process: woken by a message naming its entry (admitted), or poked to
  // look again (the subscriber reconnected, or, for counters, permits were released).
  struct Waiter {
    bool admitted = false;
    bool poked = false;
  };

  milliseconds recheck_interval() const { return std::min(milliseconds(2000), settings_.ttl / 3); }
  void on_message(const std::string& channel, const std::string& payload);
  void on_subscriber_reset();
  void watchdog_loop(std::stop_token stop);
  // Sleeps until the waiter is woken, the re-check interval passes, or the deadline.
  void sleep_as(Waiter& waiter, Deadline deadline);
  // Leaves the queue, best effort: an entry left behind expires by itself after one TTL.
  void abandon(const QueueKeys& keys, std::uint64_t seq) noexcept;

  Settings settings_;
  std::string identity_;  // "<pid> <host>", for inspect
  RequestIds request_ids_;
  Connection connection_;

  std::mutex waiters_mutex_;
  std::condition_variable waiters_cv_;
  std::map<std::string, std::map<std::string, Waiter*>> queue_waiters_;  // channel -> seq -> waiter
  std::map<std::string, std::deque<Waiter*>> counter_waiters_;          // channel -> oldest first
  // Admissions announced before their waiter registered (it was still reading the acquire
  // reply): kept briefly, per channel, for the waiter to find.
  std::map<std::string, std::deque<std::string>> early_admissions_;

  std::mutex holds_mutex_;
  std::condition_variable_any watchdog_cv_;
  std::set<RedisHold*> holds_;

  Subscriber subscriber_;  // after the waiter tables: its thread calls into them
  std::jthread watchdog_;  // last: stopped and joined first
};

RedisHold::RedisHold(RedisBackend& backend, std::string name, std::uint64_t seq, std::shared_ptr<LossSignal> loss,
                     std::uint64_t server_generation, SteadyClock::time_point renewed_at)
    : backend_(backend), name_(std::move(name)), seq_(seq), loss_(std::move(loss)),
      server_generation_(server_generation), renewed_at_(renewed_at) {
  backend_.track(this);
}

RedisHold::~RedisHold() {
  if (!released_) backend_.untrack(this);  // the core releases first; this only guards misuse
}

void RedisHold::downgrade() {
  const auto keys = queue_keys(name_);
  auto reply = backend_.connection().eval(scripts::downgrade, keys.keys, {keys.channel, std::to_string(seq_)},
                                          SteadyClock::now() + milliseconds(5000), true);
  if (reply->integer == 0) loss_->lose("its entry expired or the redis server forgot it");
}

void RedisHold::release() {
  if (released_) return;
  const auto keys = queue_keys(name_);
  auto reply = backend_.connection().eval(scripts::release, keys.keys, {keys.channel, std::to_string(seq_)},
                                          SteadyClock::now() + milliseconds(2000), true);
  released_ = true;
  backend_.untrack(this);
  if (reply->integer == 0) loss_->lose("its entry had expired or the redis server forgot it before the release");
}

void RedisBackend::on_message(const std::string& channel, const std::string& payload) {
  std::lock_guard lock(waiters_mutex_);
  if (channel.size() > 2 && channel.compare(channel.size() - 2, 2, ":w") == 0) {
    const auto queue = queue_waiters_.find(channel);
    std::istringstream seqs(payload);
    for (std::string seq; seqs >> seq;) {
      if (queue != queue_waiters_.end()) {
        if (const auto it = queue->second.find(seq); it != queue->second.end()) {
          it->second->admitted = true;
          continue;
        }
      }
      auto& early = early_admissions_[channel];
      early.push_back(seq);
      if (early.size() > 64) early.pop_front();
    }
  }
  // Only this client's oldest waiter of a counter can be first in line: it alone looks again.
  if (const auto counter = counter_waiters_.find(channel); counter != counter_waiters_.end() && !counter->second.empty()) {
    counter->second.front()->poked = true;
  }
  waiters_cv_.notify_all();
}

void RedisBackend::on_subscriber_reset() {
  std::lock_guard lock(waiters_mutex_);
  for (auto& [channel, waiters] : queue_waiters_) {
    for (auto& [seq, waiter] : waiters) waiter->poked = true;
  }
  for (auto& [channel, waiters] : counter_waiters_) {
    for (auto* waiter : waiters) waiter->poked = true;
  }
  waiters_cv_.notify_all();
}

void RedisBackend::sleep_as(Waiter& waiter, Deadline deadline) {
  auto until = SteadyClock::now() + recheck_interval();
  if (deadline) until = std::min(until, *deadline);
  std::unique_lock lock(waiters_mutex_);
  waiters_cv_.wait_until(lock, until, [&] { return waiter.admitted || waiter.poked; });
  waiter.poked = false;
}

void RedisBackend::abandon(const QueueKeys& keys, std::uint64_t seq) noexcept {
  try {
    connection_.eval(scripts::release, keys.keys, {keys.channel, std::to_string(seq)},
                     SteadyClock::now() + milliseconds(2000), true);
  } catch (...) {
  }
}

std::unique_ptr<BackendHold> RedisBackend::acquire(const QueueRequest& request, Deadline deadline,
                                                   std::shared_ptr<LossSignal> loss) {
  const auto keys = queue_keys(request.name);
  const bool try_once = deadline && *deadline <= SteadyClock::now();
  const auto request_id = request_ids_.next();
  const bool was_listening = !try_once && subscriber_.listening(keys.channel);
  auto sent_at = SteadyClock::now();
  std::uint64_t generation = 0;
  auto reply = connection_.eval(scripts::acquire, keys.keys,
                                {keys.channel, std::string(1, kind_code(request.kind)), std::to_string(request.permits),
                                 std::to_string(request.limit), std::to_string(settings_.ttl.count()), try_once ? "1" : "0",
                                 request_id, identity_},
                                deadline, true, &generation);
  const auto status = integer_at(reply.get(), 0);
  if (status == -1) check_queue_mode(request, string_at(reply.get(), 1), 0);
  if (status == -2) check_queue_mode(request, "semaphore", integer_at(reply.get(), 1));
  if (status == 0) return nullptr;
  if (status != 1 && status != 2) throw BackendUnavailable("redis answered acquire with status " + std::to_string(status));
  const auto seq = static_cast<std::uint64_t>(integer_at(reply.get(), 1));
  if (status == 1) return std::make_unique<RedisHold>(*this, request.name, seq, std::move(loss), generation, sent_at);

  // Waiting in line: listen for our sequence number, and look again now and then.
  const auto seq_text = std::to_string(seq);
  Waiter waiter;
  {
    std::lock_guard lock(waiters_mutex_);
    queue_waiters_[keys.channel][seq_text] = &waiter;
    if (auto early = early_admissions_.find(keys.channel); early != early_admissions_.end()) {
      auto& seqs = early->second;
      if (const auto it = std::find(seqs.begin(), seqs.end(), seq_text); it != seqs.end()) {
        waiter.admitted = true;
        seqs.erase(it);
      }
      if (seqs.empty()) early_admissions_.erase(early);
    }
  }
  struct Unregister {
    RedisBackend& backend;
    const QueueKeys& keys;
    const std::string& seq;
    ~Unregister() {
      {
        std::lock_guard lock(backend.waiters_mutex_);
        auto& waiters = backend.queue_waiters_[keys.channel];
        waiters.erase(seq);
        if (waiters.empty()) backend.queue_waiters_.erase(keys.channel);
      }
      backend.subscriber_.unsubscribe(keys.channel);
    }
  } unregister{*this, keys, seq_text};
  auto confirm_until = SteadyClock::now() + milliseconds(1000);
  if (deadline) confirm_until = std::min(confirm_until, *deadline);
  subscriber_.subscribe(keys.channel, confirm_until);
  // Subscribed before the acquire script ran: every admission since reached us. Otherwise one
  // look now covers a message published before the subscription took.
  bool look_now = !was_listening;
  try {
    for (;;) {
      {
        std::lock_guard lock(waiters_mutex_);
        if (waiter.admitted) break;
      }
      if (look_now) {
        // The periodic look: renews our place and catches a message we may have missed.
        sent_at = SteadyClock::now();
        auto state = connection_.eval(scripts::renew, keys.keys,
                                      {keys.channel, std::to_string(settings_.ttl.count()), seq_text}, deadline, true,
                                      &generation);
        const auto where = integer_at(state.get(), 0);
        if (where == 0) {
          throw HoldLost("the queue entry of '" + request.name +
                         "' expired while waiting (paused past the TTL, or the redis server restarted)");
        }
        if (where == 2) break;
      }
      look_now = true;
      if (deadline && *deadline <= SteadyClock::now()) {
        abandon(keys, seq);
        return nullptr;
      }
      sleep_as(waiter, deadline);
    }
  } catch (const HoldLost&) {
    throw;
  } catch (...) {
    abandon(keys, seq);
    throw;
  }
  return std::make_unique<RedisHold>(*this, request.name, seq, std::move(loss), generation, sent_at);
}

// Renews every hold every TTL/3. A hold is suspended while renewals fail (each given up after
// a second at most and tried again soon) and held again once one gets through. It is reported
// lost when the server no longer has its entry, when the server turned out to be another one
// (restarted without persistence), or when no renewal got through for a whole TTL (a pause,
// or the server unreachable): the server may have expired it and granted it to someone else.
void RedisBackend::watchdog_loop(std::stop_token stop) {
  const auto period = std::max(milliseconds(100), settings_.ttl / 3);
  const auto retry = std::min(period, milliseconds(250));
  // A renewal unanswered for this long suspends the holds: redis normally answers in well under
  // a millisecond, and the sooner a stalled round gives up, the sooner it is tried again.
  const auto patience = std::min(period, milliseconds(1000));
  // Renewals confirmed before this much of the TTL is left are safe from clock-rate drift.
  const auto margin = settings_.ttl / 10;
  std::unique_lock lock(holds_mutex_);
  auto wait = period;
  while (!stop.stop_requested()) {
    watchdog_cv_.wait_for(lock, stop, wait, [] { return false; });
    wait = period;
    if (stop.stop_requested()) break;
    std::map<std::string, std::vector<RedisHold*>> by_name;
    for (auto* hold : holds_) {
      if (!hold->loss().lost()) by_name[hold->name()].push_back(hold);
    }
    if (by_name.empty()) continue;
    std::vector<std::tuple<const Script*, std::vector<std::string>, std::vector<std::string>>> calls;
    std::vector<std::vector<RedisHold*>> groups;
    const auto now = SteadyClock::now();
    // Signals, not holds: a hold may be released and destroyed while we report it.
    std::vector<std::pair<std::shared_ptr<LossSignal>, std::string>> losses;
    for (auto& [name, holds] : by_name) {
      const auto keys = queue_keys(name);
      std::vector<std::string> args{keys.channel, std::to_string(settings_.ttl.count())};
      std::vector<RedisHold*> renewing;
      for (auto* hold : holds) {
        if (now - hold->renewed_at() >= settings_.ttl - margin) {
          losses.emplace_back(hold->loss_signal(), "no renewal reached redis for a whole TTL (the process was paused or the server unreachable)");
        } else {
          args.push_back(std::to_string(hold->seq()));
          renewing.push_back(hold);
        }
      }
      if (renewing.empty()) continue;
      calls.emplace_back(&scripts::renew, keys.keys, std::move(args));
      groups.push_back(std::move(renewing));
    }
    // lose() runs user callbacks, which may release holds: never with holds_mutex_ held.
    lock.unlock();
    for (auto& [signal, why] : losses) signal->lose(why);
    lock.lock();
    if (calls.empty()) continue;
    // No lock during the round trip (releases must not wait for it): renew a snapshot of
    // sequence numbers and look the holds up again afterwards.
    std::vector<std::vector<std::pair<std::string, std::uint64_t>>> snapshot;
    for (auto& group : groups) {
      snapshot.emplace_back();
      for (auto* hold : group) snapshot.back().emplace_back(hold->name(), hold->seq());
    }
    lock.unlock();
    std::vector<Reply> replies;
    std::uint64_t generation_now = 0;
    try {
      // The generation of the server that answered: holds made on an older one are gone.
      replies = connection_.eval_pipelined(calls, now + patience, &generation_now);
    } catch (const Error&) {
      // Not confirmed, but perhaps still alive: suspended until a renewal gets through, lost
      // when none did for a whole TTL (the next rounds check).
      lock.lock();
      std::vector<std::shared_ptr<LossSignal>> unconfirmed;
      for (auto* hold : holds_) unconfirmed.push_back(hold->loss_signal());
      lock.unlock();
      for (auto& signal : unconfirmed) signal->suspend("the renewal did not reach redis; its entry may still be alive");
      lock.lock();
      wait = retry;
      continue;
    }
    lock.lock();
    std::vector<std::pair<std::shared_ptr<LossSignal>, std::string>> gone;
    std::vector<std::shared_ptr<LossSignal>> confirmed;
    for (std::size_t g = 0; g < snapshot.size(); ++g) {
      for (std::size_t i = 0; i < snapshot[g].size(); ++i) {
        RedisHold* hold = nullptr;
        for (auto* candidate : holds_) {
          if (candidate->name() == snapshot[g][i].first && candidate->seq() == snapshot[g][i].second) hold = candidate;
        }
        if (!hold) continue;  // released meanwhile
        const auto where = integer_at(replies[g].get(), i);
        if (where == 0) {
          gone.emplace_back(hold->loss_signal(), "its entry expired or the redis server forgot it");
        } else if (hold->server_generation() != generation_now) {
          gone.emplace_back(hold->loss_signal(), "the redis server was replaced or restarted without its data");
        } else {
          hold->set_renewed_at(now);
          confirmed.push_back(hold->loss_signal());
        }
      }
    }
    lock.unlock();
    for (auto& [signal, why] : gone) signal->lose(why);
    for (auto& signal : confirmed) signal->resume();
    lock.lock();
  }
}

Inspection RedisBackend::inspect(const std::string& name) {
  const auto keys = queue_keys(name);
  const auto counter = counter_keys(name);
  auto replies = connection_.eval_pipelined({{&scripts::inspect, keys.keys, {keys.channel}},
                                             {&scripts::counter_inspect, counter.keys, {counter.channel}}},
                                            SteadyClock::now() + milliseconds(5000));
  for (const auto& reply : replies) {
    if (reply->type == REDIS_REPLY_ERROR) throw BackendUnavailable("redis inspect failed: " + std::string(reply->str, reply->len));
  }
  Inspection result;
  result.name = name;
  const auto* queue = replies[0].get();
  for (std::size_t i = 0; i < queue->elements; ++i) {
    const auto* item = queue->element[i];
    EntryInfo info;
    info.fencing_token = static_cast<std::uint64_t>(integer_at(item, 0));
    // "<kind><admitted> <permits> <limit> <request> <pid> <host> <since ms>"
    std::istringstream text(string_at(item, 1));
    std::string state, request;
    std::int64_t limit = 0;
    long long since_ms = 0;
    text >> state >> info.permits >> limit >> request >> info.pid >> info.host >> since_ms;
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
  const auto* permits = replies[1].get();
  if (permits->elements > 0 && permits->element[0]->type == REDIS_REPLY_STRING) {
    result.permits = std::stoll(string_at(permits, 0));
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

bool RedisBackend::counter_try_set(const std::string& name, std::int64_t permits) {
  const auto keys = counter_keys(name);
  auto reply = connection_.eval(scripts::counter_try_set, keys.keys, {keys.channel, std::to_string(permits)},
                                SteadyClock::now() + milliseconds(5000), false);
  return reply->integer == 1;
}

std::int64_t RedisBackend::counter_add(const std::string& name, std::int64_t delta) {
  const auto keys = counter_keys(name);
  try {
    auto reply = connection_.eval(scripts::counter_add, keys.keys, {keys.channel, std::to_string(delta)},
                                  SteadyClock::now() + milliseconds(5000), false);
    return reply->integer;
  } catch (const BackendUnavailable& error) {
    if (std::string(error.what()).find("overflow") != std::string::npos) {
      throw InvalidArgument("PermitCounter '" + name + "': adding " + std::to_string(delta) + " would overflow");
    }
    throw;
  }
}

std::optional<std::int64_t> RedisBackend::counter_get(const std::string& name) {
  auto reply = connection_.command({"GET", name}, SteadyClock::now() + milliseconds(5000));
  if (reply->type == REDIS_REPLY_NIL) return std::nullopt;
  try {
    return std::stoll(std::string(reply->str, reply->len));
  } catch (const std::exception&) {
    throw BackendUnavailable("the PermitCounter key '" + name + "' does not hold a number");
  }
}

std::int64_t RedisBackend::counter_drain(const std::string& name) {
  const auto keys = counter_keys(name);
  auto reply = connection_.eval(scripts::counter_drain, keys.keys, {keys.channel}, SteadyClock::now() + milliseconds(5000), false);
  return reply->integer;
}

bool RedisBackend::counter_acquire(const std::string& name, std::int64_t permits, Deadline deadline) {
  const auto keys = counter_keys(name);
  std::string place;  // our sequence number in line, once we wait
  Waiter waiter;
  bool registered = false;
  const auto unregister = [&] {
    if (!registered) return;
    {
      std::lock_guard lock(waiters_mutex_);
      auto& line = counter_waiters_[keys.channel];
      line.erase(std::find(line.begin(), line.end(), &waiter));
      // The next local waiter may be first in line now.
      if (!line.empty()) line.front()->poked = true;
      if (line.empty()) counter_waiters_.erase(keys.channel);
      waiters_cv_.notify_all();
    }
    subscriber_.unsubscribe(keys.channel);
    registered = false;
  };
  try {
    for (;;) {
      const bool last_try = deadline && *deadline <= SteadyClock::now();
      // Not retried after an unknown outcome: the permits may have been taken.
      auto reply = connection_.eval(scripts::counter_acquire, keys.keys,
                                    {keys.channel, std::to_string(permits), place, std::to_string(settings_.ttl.count()),
                                     last_try ? "1" : "0", identity_},
                                    deadline ? std::max(*deadline, SteadyClock::now() + milliseconds(1000)) : deadline, false);
      const auto status = integer_at(reply.get(), 0);
      if (status == 1 || status == 0) {
        unregister();
        return status == 1;
      }
      place = std::to_string(integer_at(reply.get(), 1));
      if (!registered) {
        {
          std::lock_guard lock(waiters_mutex_);
          counter_waiters_[keys.channel].push_back(&waiter);
        }
        registered = true;
        auto confirm_until = SteadyClock::now() + milliseconds(1000);
        if (deadline) confirm_until = std::min(confirm_until, *deadline);
        subscriber_.subscribe(keys.channel, confirm_until);
        continue;  // look once more now that no release can go unheard
      }
      sleep_as(waiter, deadline);
    }
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
  return std::make_unique<RedisBackend>(parse_settings(url, options));
}
