// SPDX-License-Identifier: Apache-2.0
#include "backends/consul/consul_backend.hpp"

#include <unistd.h>

#include <curl/curl.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>

#include "core/host_name.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail::consul {
namespace {

std::string env(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}

std::int64_t now_ms() {
  return std::chrono::duration_cast<milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

// consul://[TOKEN@]host:port[?ttl=&lock_delay=&dc=], consuls:// with cacert=; no host: Consul's
// own environment (CONSUL_HTTP_ADDR, CONSUL_HTTP_TOKEN, CONSUL_HTTP_SSL, CONSUL_CACERT).
Settings parse_settings(const BackendUrl& url, const ClientOptions& options) {
  Settings settings;
  bool tls = url.scheme == "consuls";
  std::string address;
  if (url.hosts.size() > 1) throw InvalidUrl("one Consul agent per URL, got several hosts in '" + url.text + "'");
  if (!url.hosts.empty()) {
    address = url.hosts.front();
  } else {
    address = env("CONSUL_HTTP_ADDR");
    for (const std::string scheme : {"http://", "https://"}) {
      if (address.rfind(scheme, 0) == 0) {
        tls = scheme == "https://";
        address = address.substr(scheme.size());
      }
    }
    if (env("CONSUL_HTTP_SSL") == "true" || env("CONSUL_HTTP_SSL") == "1") tls = true;
    if (address.empty()) address = "127.0.0.1:8500";
  }
  const auto host = [&] {
    if (!url.hosts.empty()) return parse_host_port(address, 8500, url);
    try {
      return parse_host_port(address, 8500, url);
    } catch (const InvalidUrl& error) {
      // The URL names no agent: the bad address is the environment's, and says so.
      throw InvalidUrl(std::string(error.what()) + "; the address came from CONSUL_HTTP_ADDR");
    }
  }();
  if (!url.path.empty() && url.path != "/") {
    throw InvalidUrl("Consul URLs take no path, got '" + url.path + "' in '" + url.text + "'");
  }
  settings.endpoint.base = std::string(tls ? "https://" : "http://") + host.host + ":" + std::to_string(host.port);
  // The whole userinfo is the token (consul://TOKEN@; a ':' in it is the token's own).
  const auto userinfo = url.user.empty()       ? url.password
                        : url.password.empty() ? url.user
                                               : url.user + ":" + url.password;
  settings.endpoint.token = !userinfo.empty() ? userinfo : env("CONSUL_HTTP_TOKEN");
  settings.endpoint.cacert = url.hosts.empty() ? env("CONSUL_CACERT") : "";
  settings.endpoint.shown = url.text;
  for (const auto& [key, value] : url.query) {
    // The TTL's lower bound is the server's (session_ttl_min, 10 s by default): it refuses less.
    if (key == "ttl") settings.session.ttl = parse_seconds(key, value, 1, 86400);
    else if (key == "lock_delay") settings.session.lock_delay = parse_seconds(key, value, 0, 60);
    else if (key == "dc") settings.endpoint.dc = value;
    else if (key == "cacert") settings.endpoint.cacert = value;
    else
      throw InvalidUrl("unknown parameter '" + key + "' in '" + url.text + "' (expected ttl, lock_delay, dc, cacert)");
  }
  check_ttl_option(options.ttl, 1);
  if (options.ttl.count() > 0) settings.session.ttl = options.ttl;
  if (options.connect_timeout.count() > 0) settings.connect_timeout = options.connect_timeout;
  settings.label = options.holder_label;
  // As `consul lock -name`: the label names the session when given.
  settings.session.name = !options.holder_label.empty() ? options.holder_label
                                                        : "turnstile " + host_name() + " " + std::to_string(getpid());
  return settings;
}

// --- calls ---------------------------------------------------------------------------------

nlohmann::json kv_op(const char* verb, const std::string& key) { return {{"KV", {{"Verb", verb}, {"Key", key}}}}; }

nlohmann::json kv_lock(const std::string& key, const std::string& value, std::uint64_t flags,
                       const std::string& session) {
  auto op = kv_op("lock", key);
  op["KV"]["Value"] = base64_encode(value);
  op["KV"]["Flags"] = flags;
  op["KV"]["Session"] = session;
  return op;
}

nlohmann::json kv_unlock(const std::string& key, std::uint64_t flags, const std::string& session) {
  auto op = kv_lock(key, "", flags, session);
  op["KV"]["Verb"] = "unlock";
  return op;
}

nlohmann::json kv_check_session(const std::string& key, const std::string& session) {
  auto op = kv_op("check-session", key);
  op["KV"]["Session"] = session;
  return op;
}

ConsulBackend::ConsulBackend(Settings settings)
    : http_(settings.endpoint), sessions_(settings.endpoint, http_, settings.session), queries_(settings.endpoint) {
  host_ = host_name();
  label_ = settings.label;
  // Reaches Consul once, so a wrong address or token is reported by connect.
  sessions_.main(settings.connect_timeout);
}

// What the caller's threads left is tried once more while the sessions still exist (their
// destruction then removes whatever is on them anyway).
ConsulBackend::~ConsulBackend() { removals_.drain(kConsulTimes.drain_at_end); }

std::vector<KvEntry> ConsulBackend::read(const std::string& key, bool recurse, milliseconds timeout,
                                         std::uint64_t* index, const std::stop_token& stop) {
  const auto reply = http_.call("GET", "/v1/kv/" + url_escape(key) + (recurse ? "?recurse" : ""), "", timeout, stop);
  if (index) *index = reply.index;
  if (reply.status == 404) return {};
  if (reply.status != 200) throw_error("reading " + key, reply, http_.endpoint());
  return parse_entries(std::string_view(reply.body));
}

std::optional<std::vector<KvEntry>> ConsulBackend::txn(const nlohmann::json& ops, milliseconds timeout,
                                                       const std::string& context, Refused* refused,
                                                       const std::stop_token& stop) {
  const auto reply = http_.call("PUT", "/v1/txn", ops.dump(), timeout, stop);
  if (reply.status != 409) {
    if (reply.status != 200) throw_error(context, reply, http_.endpoint());
    return parse_txn_results(nlohmann::json::parse(reply.body, nullptr, false));
  }
  auto why = read_refusal(reply, ops, context, http_.endpoint());
  if (refused) *refused = std::move(why);
  return std::nullopt;
}

std::optional<std::uint64_t> ConsulBackend::released_lock_index(const std::string& name) {
  std::lock_guard lock(released_mutex_);
  const auto found = released_locks_.find(name);
  if (found == released_locks_.end()) return std::nullopt;
  return found->second;
}

void ConsulBackend::note_released_lock(const std::string& name, std::optional<std::uint64_t> index) {
  constexpr std::size_t kRemembered = 4096;  // names; past this, the oldest knowledge is dropped
  std::lock_guard lock(released_mutex_);
  if (!index) {
    released_locks_.erase(name);
    return;
  }
  if (released_locks_.size() >= kRemembered && !released_locks_.count(name)) released_locks_.clear();
  released_locks_[name] = *index;
}

bool ConsulBackend::crowded(const std::string& name) {
  std::lock_guard lock(released_mutex_);
  return crowded_.count(name) > 0;
}

void ConsulBackend::note_crowded(const std::string& name, bool crowded) {
  constexpr std::size_t kRemembered = 4096;  // names; past this, forgotten (the take is tried again)
  std::lock_guard lock(released_mutex_);
  if (!crowded) {
    crowded_.erase(name);
    return;
  }
  if (crowded_.size() >= kRemembered) crowded_.clear();
  crowded_.insert(name);
}

bool ConsulBackend::write(const char* method, const std::string& path, const std::string& body, milliseconds timeout,
                          const std::string& context) {
  const auto reply = http_.call(method, path, body, timeout);
  // An acquire with a session the server no longer has (kvsLockTxn: 'invalid session "ID"',
  // HTTP 500): refused, as a lock held by another would be; the caller reads it as its session gone.
  if (refused_for_invalid_session(reply)) return false;
  if (reply.status != 200) throw_error(context, reply, http_.endpoint());
  return reply.body.find("true") != std::string::npos;
}

void ConsulBackend::block(const WaitTarget& target, const CallBudget& budget) {
  block(std::vector<WaitTarget>{target}, budget);
}

namespace {

// A wait on one entry of turnstile's queues (a lock's or a counter line's) may share its
// client's query on the whole queue (blocking_queries.hpp); a wait on anything else (a peer's
// key, NAME/ of api.Semaphore, a whole queue's change) keeps its own query.
bool shareable(const WaitTarget& target) {
  if (target.recurse || target.retry || target.index == 0) return false;
  for (const char* root : {"turnstile/q/", "turnstile/cq/"}) {
    if (target.key.rfind(root, 0) == 0 && target.key.back() != '/') return true;
  }
  return false;
}

}  // namespace

// What a wait on `targets` sends: a blocking query per target (Consul's wait within the
// deadline), or a timer when an index is not known (at once; after a lock-delay, a while).
BlockingPlan ConsulBackend::plan_block(const std::vector<WaitTarget>& targets, const Deadline& deadline) const {
  BlockingPlan plan;
  for (const auto& target : targets) {
    if (target.index != 0) continue;
    // A lock-delay on a key that is gone (its session's Behavior delete took it): nothing in
    // the store will change when the delay ends, so look again after a while, as api.Lock does.
    if (target.retry) plan.pause = kLockDelayRetry;
    return plan;  // an index not known: look again at once
  }
  const bool retry = std::any_of(targets.begin(), targets.end(), [](const WaitTarget& t) { return t.retry; });
  auto wait = retry ? kLockDelayRetry : kBlockingWaitMax;
  auto timeout = wait + wait / 16 + kBlockingSlack;
  if (const auto left = CallBudget(deadline).left()) {
    if (*left <= milliseconds(0)) return plan;
    // Consul may add wait/16 of jitter: asked for 16/17 of what is left, it answers in time.
    wait = std::min(wait, std::max(*left * 16 / 17, milliseconds(1)));
    timeout = std::min(timeout, *left + kDeadlineGrace);
  }
  plan.wait = wait;
  for (const auto& target : targets) {
    if (targets.size() == 1 && shareable(target)) {
      plan.shared =
          SharedTarget{target.key.substr(0, target.key.rfind('/') + 1), target.key, target.index, 0, target.first_look};
    }
    // A first look's own query (sent only while it waits alone): answered at once, then it reads.
    const auto query = target.first_look
                           ? std::string()
                           : "?index=" + std::to_string(target.index) + "&wait=" + std::to_string(wait.count()) + "ms" +
                                 (target.recurse ? "&recurse" : "");
    plan.queries.push_back({"GET", "/v1/kv/" + url_escape(target.key) + query, ""});
    plan.keys.push_back(target.key);
  }
  plan.timeout = timeout;
  return plan;
}

std::unique_ptr<WakeArm> ConsulBackend::arm_block(const std::vector<WaitTarget>& targets, const Deadline& deadline,
                                                  QueryWake wake) {
  return queries_.arm(plan_block(targets, deadline), std::move(wake));
}

// An arm and a condition variable: the blocking waits share the async ones' queries and I/O
// thread. The first query to answer ends the wait (the others are cut); one dropped (a restart,
// a cut link) or ended at the deadline returns after a short pause: the caller looks again, and
// its look resends until the server answers, the deadline or a stop.
std::uint64_t ConsulBackend::block(const std::vector<WaitTarget>& targets, const CallBudget& budget) {
  if (budget.passed() || targets.empty()) return 0;
  auto plan = plan_block(targets, budget.deadline());
  if (plan.queries.empty() && plan.pause <= milliseconds(0)) return 0;  // look again at once
  struct {
    std::mutex mutex;
    std::condition_variable_any changed;
    bool woken = false;
    std::exception_ptr error;
    std::uint64_t answer = 0;
  } ended;
  auto armed = queries_.arm(std::move(plan), [&ended](std::exception_ptr error, std::uint64_t answer) {
    std::lock_guard lock(ended.mutex);
    ended.woken = true;
    ended.error = std::move(error);
    ended.answer = answer;
    ended.changed.notify_all();
  });
  {
    std::unique_lock lock(ended.mutex);
    const auto woken = [&] { return ended.woken; };
    if (budget.deadline()) ended.changed.wait_until(lock, budget.stop(), *budget.deadline(), woken);
    else ended.changed.wait(lock, budget.stop(), woken);
  }
  armed.reset();  // disarmed: the wake is not running any more, `ended` may go
  if (ended.error) std::rethrow_exception(ended.error);
  return ended.answer;
}

bool ConsulBackend::pause_before_retry(const CallBudget& budget, milliseconds& backoff) {
  if (passed(budget.deadline())) return false;
  pause_within(budget, backoff);
  backoff = std::min(backoff * 2, kResendBackoffMax);
  return !budget.passed();
}

EntryValue ConsulBackend::new_value(const QueueRequest& request) const {
  EntryValue value;
  value.kind = request.kind;
  value.permits = request.permits;
  value.limit = request.limit;
  value.pid = getpid();
  value.host = host_;
  value.since_ms = now_ms();
  value.label = label_;
  value.election = request.primitive == Primitive::election;
  value.proposal = request.value;
  return value;
}

std::unique_ptr<QueuePlace> ConsulBackend::join(const QueueRequest& request, bool try_once, Deadline deadline,
                                                Standing& first) {
  return make_place(*this, request, try_once, deadline, first);
}

std::unique_ptr<CounterLine> ConsulBackend::counter_line(const std::string& name, std::int64_t permits,
                                                         const std::stop_token& stop) {
  return make_counter_line(*this, name, permits, stop);
}

}  // namespace turnstile::detail::consul

extern "C" std::unique_ptr<turnstile::detail::Backend> turnstile_backend_factory_v2(
    const turnstile::detail::BackendUrl& url, const turnstile::ClientOptions& options,
    turnstile::detail::BackendReports& reports) {
  using namespace turnstile::detail::consul;
  static std::once_flag curl_ready;
  std::call_once(curl_ready, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  auto settings = parse_settings(url, options);
  settings.endpoint.reports = &reports;
  return std::make_unique<ConsulBackend>(std::move(settings));
}
