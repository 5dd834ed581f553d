#include "backends/consul/consul_backend.hpp"

#include <unistd.h>

#include <curl/curl.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <thread>

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

std::optional<std::int64_t> counter_value(const std::vector<KvEntry>& entries) {
  if (entries.empty()) return std::nullopt;
  return counter_value_of(entries.front().value).n;
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
  const auto host = parse_host_port(address, 8500, url);
  if (!url.path.empty() && url.path != "/") {
    throw InvalidUrl("Consul URLs take no path, got '" + url.path + "' in '" + url.text + "'");
  }
  settings.endpoint.base = std::string(tls ? "https://" : "http://") + host.host + ":" + std::to_string(host.port);
  // The whole userinfo is the token (consul://TOKEN@; a ':' in it is the token's own).
  const auto userinfo = url.user.empty() ? url.password : url.password.empty() ? url.user : url.user + ":" + url.password;
  settings.endpoint.token = !userinfo.empty() ? userinfo : env("CONSUL_HTTP_TOKEN");
  settings.endpoint.cacert = url.hosts.empty() ? env("CONSUL_CACERT") : "";
  settings.endpoint.shown = url.text;
  for (const auto& [key, value] : url.query) {
    // The TTL's lower bound is the server's (session_ttl_min, 10 s by default): it refuses less.
    if (key == "ttl") settings.session.ttl = parse_seconds(key, value, 1, 86400);
    else if (key == "lock_delay") settings.session.lock_delay = parse_seconds(key, value, 0, 60);
    else if (key == "dc") settings.endpoint.dc = value;
    else if (key == "cacert") settings.endpoint.cacert = value;
    else throw InvalidUrl("unknown parameter '" + key + "' in '" + url.text + "' (expected ttl, lock_delay, dc, cacert)");
  }
  check_ttl_option(options.ttl, 1);
  if (options.ttl.count() > 0) settings.session.ttl = options.ttl;
  if (options.connect_timeout.count() > 0) settings.connect_timeout = options.connect_timeout;
  settings.label = options.holder_label;
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  // As `consul lock -name`: the label names the session when given.
  settings.session.name = !options.holder_label.empty() ? options.holder_label
                                                        : "turnstile " + std::string(name) + " " + std::to_string(getpid());
  return settings;
}

// --- background removals -----------------------------------------------------------------

Cleanup::Cleanup() : thread_([this](std::stop_token stop) { run(stop); }) {}

Cleanup::~Cleanup() {
  thread_.request_stop();
  wake_.notify_all();
}

void Cleanup::add(std::function<bool()> job) {
  std::lock_guard lock(mutex_);
  jobs_.push_back({std::move(job), SteadyClock::now() + kCleanupGiveUp});
  wake_.notify_all();
}

void Cleanup::run(std::stop_token stop) {
  while (!stop.stop_requested()) {
    std::deque<Job> round;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, stop, [&] { return !jobs_.empty(); });
      round.swap(jobs_);
    }
    std::deque<Job> again;
    for (auto& job : round) {
      bool done = false;
      try {
        done = job.work();
      } catch (...) {
        done = false;
      }
      if (!done && SteadyClock::now() < job.give_up) again.push_back(std::move(job));
    }
    if (again.empty()) continue;
    std::unique_lock lock(mutex_);
    for (auto& job : again) jobs_.push_back(std::move(job));
    wake_.wait_for(lock, stop, kCleanupRetry, [] { return false; });
  }
}

// --- calls ---------------------------------------------------------------------------------

milliseconds call_timeout(Deadline deadline, milliseconds floor) {
  if (!deadline) return kCallCap;
  const auto left = std::chrono::duration_cast<milliseconds>(*deadline - SteadyClock::now());
  if (left <= milliseconds(0)) return floor;
  return std::clamp(left, std::min(floor, kTimedCallFloor), kCallCap);
}

nlohmann::json kv_op(const char* verb, const std::string& key) { return {{"KV", {{"Verb", verb}, {"Key", key}}}}; }

nlohmann::json kv_lock(const std::string& key, const std::string& value, std::uint64_t flags, const std::string& session) {
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
    : http_(settings.endpoint), sessions_(settings.endpoint, http_, settings.session) {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  host_ = name;
  label_ = settings.label;
  // Reaches Consul once, so a wrong address or token is reported by connect.
  sessions_.main(settings.connect_timeout);
}

ConsulBackend::~ConsulBackend() = default;

std::vector<KvEntry> ConsulBackend::read(const std::string& key, bool recurse, milliseconds timeout,
                                         std::uint64_t* index, const std::stop_token& stop) {
  const auto reply = http_.call("GET", "/v1/kv/" + url_escape(key) + (recurse ? "?recurse" : ""), "", timeout, stop);
  if (index) *index = reply.index;
  if (reply.status == 404) return {};
  if (reply.status != 200) throw_error("reading " + key, reply, http_.endpoint());
  return parse_entries(nlohmann::json::parse(reply.body, nullptr, false));
}

std::optional<std::vector<KvEntry>> ConsulBackend::txn(const nlohmann::json& ops, milliseconds timeout,
                                                       const std::string& context, Refused* refused,
                                                       const std::stop_token& stop) {
  const auto reply = http_.call("PUT", "/v1/txn", ops.dump(), timeout, stop);
  if (reply.status != 409) {
    if (reply.status != 200) throw_error(context, reply, http_.endpoint());
    return parse_txn_results(nlohmann::json::parse(reply.body, nullptr, false));
  }
  Refused local;
  Refused& why = refused ? *refused : local;
  why.clear();
  const auto answer = nlohmann::json::parse(reply.body, nullptr, false);
  if (const auto errors = answer.find("Errors"); answer.is_object() && errors != answer.end() && errors->is_array()) {
    for (const auto& error : *errors) {
      if (!error.is_object() || !error.contains("OpIndex") || !error["OpIndex"].is_number_unsigned()) continue;
      const auto what = error.value("What", std::string());
      why.add({error["OpIndex"].get<std::size_t>(), refusal_of(what), what});
    }
  }
  for (const auto& op : why.ops()) {
    if (op.why != Refusal::permission_denied) continue;
    std::string key;
    if (op.op < ops.size()) key = ops[op.op]["KV"].value("Key", std::string());
    throw AccessDenied(context + " at " + http_.endpoint().shown + ": Consul refused it: " + op.what.substr(0, 200) +
                       " (the ACL token may not " + ops[op.op]["KV"].value("Verb", std::string("use")) + " key '" +
                       key + "')");
  }
  // No caller expects these: nothing was applied, and trying again would change nothing.
  if (why.ops().empty() || why.any(Refusal::other)) {
    throw BackendUnavailable(context + " at " + http_.endpoint().shown + ": Consul refused the transaction: " +
                             why.describe());
  }
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

bool ConsulBackend::write(const char* method, const std::string& path, const std::string& body, milliseconds timeout,
                          const std::string& context) {
  const auto reply = http_.call(method, path, body, timeout);
  // An acquire with a session the server no longer has (kvsLockTxn: 'invalid session "ID"',
  // HTTP 500): refused, as a lock held by another would be; the caller reads it as its session gone.
  if (reply.status == 500 && refusal_of(reply.body) == Refusal::invalid_session) return false;
  if (reply.status != 200) throw_error(context, reply, http_.endpoint());
  return reply.body.find("true") != std::string::npos;
}

void ConsulBackend::block(const WaitTarget& target, Deadline deadline, const std::stop_token& stop) {
  block(std::vector<WaitTarget>{target}, deadline, stop);
}

void ConsulBackend::block(const std::vector<WaitTarget>& targets, Deadline deadline, const std::stop_token& stop) {
  if (stop.stop_requested() || targets.empty()) return;
  for (const auto& target : targets) {
    if (target.index != 0) continue;
    // A lock-delay on a key that is gone (its session's Behavior delete took it): nothing in
    // the store will change when the delay ends, so look again after a while, as api.Lock does.
    if (target.retry) {
      auto pause = kLockDelayRetry;
      pause_before_resend(deadline, stop, pause);
    }
    return;  // an index not known: look again at once
  }
  const bool retry = std::any_of(targets.begin(), targets.end(), [](const WaitTarget& t) { return t.retry; });
  auto wait = retry ? kLockDelayRetry : kBlockingWaitMax;
  auto timeout = wait + wait / 16 + kBlockingSlack;
  if (deadline) {
    const auto left = std::chrono::duration_cast<milliseconds>(*deadline - SteadyClock::now());
    if (left <= milliseconds(0)) return;
    // Consul may add wait/16 of jitter: asked for 16/17 of what is left, it answers in time.
    wait = std::min(wait, std::max(left * 16 / 17, milliseconds(1)));
    timeout = std::min(timeout, left + kDeadlineGrace);
  }
  std::vector<Request> queries;
  for (const auto& target : targets) {
    queries.push_back({"GET", "/v1/kv/" + url_escape(target.key) + "?index=" + std::to_string(target.index) +
                                  "&wait=" + std::to_string(wait.count()) + "ms" + (target.recurse ? "&recurse" : ""), ""});
  }
  // One query per target, at once: the first to answer ends the wait (the others are cut).
  const auto outcomes = http_.call_each(queries, queries.size(), timeout, SteadyClock::time_point::max(), stop, true);
  for (std::size_t i = 0; i < outcomes.size(); ++i) {
    if (outcomes[i].stopped) return;
    if (!outcomes[i].reply) continue;
    if (outcomes[i].reply->status == 200 || outcomes[i].reply->status == 404) return;
    throw_error("waiting on " + targets[i].key, *outcomes[i].reply, http_.endpoint());
  }
  // Dropped (a restart, a cut link) or ended at the deadline: the caller looks again, and its
  // look resends until the server answers, the deadline or a stop.
  auto backoff = kResendBackoffMax / 4;
  pause_before_resend(deadline, stop, backoff);
}

bool ConsulBackend::pause_before_resend(Deadline deadline, const std::stop_token& stop, milliseconds& backoff) {
  auto pause = backoff;
  if (deadline) {
    const auto left = std::chrono::duration_cast<milliseconds>(*deadline - SteadyClock::now());
    if (left <= milliseconds(0)) return false;
    pause = std::min(pause, left);
  }
  std::mutex mutex;
  std::condition_variable_any woken;
  std::unique_lock lock(mutex);
  woken.wait_for(lock, stop, pause, [] { return false; });
  backoff = std::min(backoff * 2, kResendBackoffMax);
  return !stop.stop_requested() && !(deadline && *deadline <= SteadyClock::now());
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
  return value;
}

std::unique_ptr<QueuePlace> ConsulBackend::join(const QueueRequest& request, bool, Deadline deadline, Standing& first) {
  return make_place(*this, request, deadline, first);
}

std::unique_ptr<CounterLine> ConsulBackend::counter_line(const std::string& name, std::int64_t permits,
                                            const std::stop_token& stop) {
  return make_counter_line(*this, name, permits, stop);
}

// --- inspection ----------------------------------------------------------------------------

namespace {

EntryInfo info_of(const KvEntry& entry, const EntryValue& value, bool holding) {
  EntryInfo info;
  info.fencing_token = holding ? entry.modify_index : entry.create_index;
  info.kind = to_string(value.kind);
  info.permits = value.permits;
  info.holding = holding;
  info.pid = value.pid;
  info.host = value.host;
  info.since = std::chrono::system_clock::time_point(milliseconds(value.since_ms));
  info.label = value.label;
  return info;
}

}  // namespace

Inspection ConsulBackend::inspect(const std::string& name, Deadline deadline) {
  // Each read gets what is left of the deadline (at least 1 ms: an answer already there counts).
  const auto timeout = [&] { return call_timeout(deadline, milliseconds(1)); };
  Inspection result;
  result.name = name;
  const auto key = encode_name(name);
  const auto queue = children(read(queue_prefix(name), true, timeout()), queue_prefix(name));
  const auto lock_keys = read(key, false, timeout());
  // An exclusive hold leaves its entry as it was written (places.cpp, hold): it holds when it
  // heads the queue and its session holds the api.Lock key, whose ModifyIndex is its token.
  std::optional<KvEntry> held_key;
  if (!lock_keys.empty() && lock_keys.front().flags == kLockFlags && !lock_keys.front().session.empty()) {
    held_key = lock_keys.front();
  }
  for (const auto& entry : queue) {
    const auto value = entry_value(entry.value);
    if (result.mode.empty()) {
      result.mode = value.kind == EntryKind::lease ? "semaphore" : "lock";
      result.limit = value.limit;
    }
    // A writer keeps the key through a downgrade (its entry then marked held, shared): its
    // token stays the key's ModifyIndex, as its hold's fencing_token() says.
    const bool has_key = &entry == &queue.front() && held_key && held_key->session == entry.session;
    const bool heads_with_key = has_key && !value.held && value.kind == EntryKind::exclusive;
    auto info = info_of(entry, value, value.held || heads_with_key);
    if (has_key && info.holding) info.fencing_token = held_key->modify_index;
    (info.holding ? result.holders : result.waiters).push_back(info);
  }
  // Holders only Consul's own clients know of: an api.Lock session, api.Semaphore holders
  // whose contender key is alive (api.Semaphore prunes the others).
  std::vector<std::pair<std::string, std::int64_t>> foreign;  // session, permits
  const auto ours = [&](const std::string& session) {
    return std::any_of(queue.begin(), queue.end(), [&](const KvEntry& mine) {
      const auto sessions = entry_value(mine.value).sessions;
      return mine.session == session || std::find(sessions.begin(), sessions.end(), session) != sessions.end();
    });
  };
  for (const auto& entry : lock_keys) {
    if (entry.flags != kLockFlags || entry.session.empty()) continue;
    if (!ours(entry.session)) foreign.emplace_back(entry.session, 1);
    if (result.mode.empty()) result.mode = "lock";
  }
  const auto under = read(key + "/", true, timeout());
  for (const auto& entry : under) {
    if (entry.key != key + "/.lock" || entry.flags != kSemaphoreFlags) continue;
    const auto lock = semaphore_lock(entry, name);
    for (const auto& [session, permits] : lock.holders) {
      const bool alive = std::any_of(under.begin(), under.end(), [&](const KvEntry& e) { return e.session == session; });
      if (permits <= 0 || !alive) continue;
      if (result.mode.empty()) {
        result.mode = "semaphore";
        result.limit = lock.limit;
      }
      if (!ours(session)) foreign.emplace_back(session, permits);
    }
  }
  for (const auto& [session, permits] : foreign) {
    EntryInfo info;
    info.kind = result.mode == "semaphore" ? "lease" : "exclusive";
    info.permits = permits;
    info.holding = true;
    info.foreign = "consul session " + session;
    const auto reply = http_.call("GET", "/v1/session/info/" + session, "", timeout());
    const auto json = nlohmann::json::parse(reply.body, nullptr, false);
    if (reply.status == 200 && json.is_array() && !json.empty() && json[0].is_object()) {
      info.foreign += " (node " + json[0].value("Node", std::string()) + ", name \"" + json[0].value("Name", std::string()) + "\")";
    }
    result.holders.insert(result.holders.begin(), info);
  }
  result.permits = counter_value(read(counter_key(name), false, timeout()));
  for (const auto& entry : children(read(line_prefix(name), true, timeout()), line_prefix(name))) {
    auto info = info_of(entry, entry_value(entry.value), false);
    info.kind = "permits";
    result.waiters.push_back(info);
  }
  return result;
}

}  // namespace turnstile::detail::consul

extern "C" std::unique_ptr<turnstile::detail::Backend> turnstile_backend_factory_v1(
    const turnstile::detail::BackendUrl& url, const turnstile::ClientOptions& options) {
  using namespace turnstile::detail::consul;
  static std::once_flag curl_ready;
  std::call_once(curl_ready, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  return std::make_unique<ConsulBackend>(parse_settings(url, options));
}
