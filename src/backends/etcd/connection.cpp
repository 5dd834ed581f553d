// SPDX-License-Identifier: Apache-2.0
#include "backends/etcd/connection.hpp"

#include <grpc/fork.h>
#include <pthread.h>

#include <cctype>
#include <charconv>
#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "backends/etcd/timeouts.hpp"
#include "core/refusal_probe.hpp"

namespace turnstile::detail::etcd {
namespace {

// --- fork handling -------------------------------------------------------------------------
// gRPC 1.51 can hand a forked child a working library (grpc_prefork / grpc_postfork_child:
// its threads stopped and restarted, its epoll set rebuilt) only when fork support was enabled
// before grpc_init (GRPC_ENABLE_FORK_SUPPORT) and no thread is inside a gRPC call at fork
// time. Debian's build registers no fork handlers itself, so this library does, after parking
// every caller: blocked streams are cancelled, unary calls finish (they have deadlines).

struct ForkState {
  std::mutex mutex;
  std::condition_variable changed;
  int active = 0;  // threads inside a GrpcScope
  bool forking = false;
  std::set<grpc::ClientContext*> streams;
};

ForkState& fork_state() {
  static auto* state = new ForkState;  // never destroyed: fork handlers may run at exit
  return *state;
}

void before_fork() {
  auto& state = fork_state();
  bool cancelled = false;
  {
    std::unique_lock lock(state.mutex);
    state.forking = true;
    for (auto* context : state.streams) context->TryCancel();
    cancelled = !state.streams.empty();
    state.changed.wait_for(lock, kForkQuiesce, [&] { return state.active == 0; });
  }
  // A cancelled stream's call is torn down on gRPC's executor threads after our caller has
  // returned. grpc_prefork joins those threads while forbidding new ExecCtx, so a teardown still
  // running then deadlocks it (seen with Debian's 1.51). Give the teardown time to finish.
  if (cancelled) std::this_thread::sleep_for(kForkTeardown);
  grpc_prefork();
}

void after_fork_in_parent() {
  grpc_postfork_parent();
  auto& state = fork_state();
  std::lock_guard lock(state.mutex);
  state.forking = false;
  state.changed.notify_all();
}

void after_fork_in_child() {
  grpc_postfork_child();
  // The child has only the forking thread: nobody else is in a scope, and the mutex may have
  // been copied in any state.
  new (&fork_state()) ForkState;
}

void enable_fork_support() {
  static std::once_flag once;
  std::call_once(once, [] {
    setenv("GRPC_ENABLE_FORK_SUPPORT", "true", 0);
    // The epoll1 poller's fork handling left parents stalled after a few forks in our tests;
    // the poll poller (plenty for a client's few connections) survives them.
    setenv("GRPC_POLL_STRATEGY", "poll", 0);
    pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
  });
}

// --- process exit ----------------------------------------------------------------------------
// A channel's last subchannel is destroyed after the channel, on a thread of gRPC's event
// engine, and with it the channel arguments that hold the last reference to that engine: the
// engine's destructor then shuts its poller down through the poll poller's list, a static of
// libgrpc. A client that failed to connect (or was destroyed) just before the process exited
// had that teardown run after exit had destroyed the list: a SEGV on the engine's thread (and,
// under ASan, a hang: its report waited for the loader's lock that exit held). One idle channel,
// never connected and never destroyed, keeps a reference to the engine for the process's life,
// so no channel's teardown ever destroys it.
const grpc::Channel& keep_event_engine_for_process() {
  // Made before any channel of ours: every later channel shares its engine (gRPC keeps the
  // default engine while anything refers to it). Never destroyed; the static keeps it reachable.
  static const auto* const anchor =
      new std::shared_ptr<grpc::Channel>(grpc::CreateChannel("127.0.0.1:1", grpc::InsecureChannelCredentials()));
  return **anchor;
}

std::string read_file(const std::string& path) {
  std::ifstream file(path);
  if (!file) throw InvalidUrl("cannot read the CA certificate file '" + path + "'");
  std::ostringstream text;
  text << file.rdbuf();
  return text.str();
}

std::string describe(const grpc::Status& status) {
  return status.error_message().empty() ? "gRPC status " + std::to_string(status.error_code()) : status.error_message();
}

// gRPC takes deadlines on the system clock only.
std::chrono::system_clock::time_point system_deadline(SteadyClock::time_point deadline) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(deadline - SteadyClock::now());
}

// gRPC reconnects to a port that refuses until the call's deadline: the first call would only
// fail at connect_by, and with a later endpoint up, the first calls would spend their time on
// the refusing one before moving on. A channel that is not up at once (failed, or still
// connecting after kRefusalProbeAfter) asks the refusal probe instead: every endpoint refusing
// is a definite answer (BackendUnavailable); else the calls start at the first endpoint that
// does not refuse. Returns that endpoint's index.
std::size_t first_endpoint_that_may_answer(grpc::Channel& first, const Settings& settings,
                                           SteadyClock::time_point connect_by) {
  {
    GrpcScope scope;
    const auto soon = system_deadline(std::min(connect_by, SteadyClock::now() + kRefusalProbeAfter));
    auto state = first.GetState(true);
    while (state != GRPC_CHANNEL_READY && state != GRPC_CHANNEL_TRANSIENT_FAILURE &&
           first.WaitForStateChange(state, soon)) {
      state = first.GetState(false);
    }
    if (state == GRPC_CHANNEL_READY) return 0;
  }
  // One bound for all: an endpoint that neither accepts nor refuses uses it up, and the calls
  // then start where they would have (the first endpoint not known to refuse).
  const auto until = std::min(connect_by, SteadyClock::now() + kRefusalProbeBound);
  for (std::size_t i = 0; i < settings.endpoints.size(); ++i) {
    if (!every_server_refuses({settings.endpoints[i]}, until)) return i;
  }
  throw BackendUnavailable("every etcd endpoint refused the connection (connection refused) at " +
                           settings.description);
}

}  // namespace

milliseconds connect_timeout(const Settings& settings) {
  return settings.connect_timeout.count() > 0 ? settings.connect_timeout : kEtcdTimes.call.cap;
}

GrpcScope::GrpcScope(grpc::ClientContext* stream_context) : stream_context_(stream_context) {
  auto& state = fork_state();
  std::unique_lock lock(state.mutex);
  state.changed.wait(lock, [&] { return !state.forking; });
  ++state.active;
  if (stream_context_) state.streams.insert(stream_context_);
}

GrpcScope::~GrpcScope() {
  auto& state = fork_state();
  std::lock_guard lock(state.mutex);
  --state.active;
  if (stream_context_) state.streams.erase(stream_context_);
  state.changed.notify_all();
}

std::string prefix_end(std::string key) {
  // The smallest key greater than every key with this prefix: the last byte below 0xff, plus 1.
  while (!key.empty() && static_cast<unsigned char>(key.back()) == 0xff) key.pop_back();
  if (key.empty()) return std::string(1, '\0');  // etcd: "\0" means "to the end"
  key.back() = static_cast<char>(static_cast<unsigned char>(key.back()) + 1);
  return key;
}

Settings parse_settings(const BackendUrl& url, const ClientOptions& options) {
  Settings settings;
  settings.holder_label = options.holder_label;
  settings.connect_timeout = options.connect_timeout;
  settings.tls = url.scheme == "etcds";
  if (url.hosts.empty()) throw InvalidUrl("no host:port in '" + url.text + "'");
  if (url.user.empty() && !url.password.empty()) {
    throw InvalidUrl("a password without a user name in '" + url.text + "' (expected user:password@)");
  }
  for (const auto& host : url.hosts) {
    // etcd endpoints are host:port: checked (as gRPC's resolver takes them), used as written.
    parse_host_port(host, 0, url);
    settings.endpoints.push_back(host);
    settings.description += (settings.description.empty() ? "" : ",") + host;
  }
  if (!url.path.empty() && url.path != "/")
    throw InvalidUrl("etcd URLs take no path, got '" + url.path + "' in '" + url.text + "'");
  settings.user = url.user;
  settings.password = url.password;
  for (const auto& [key, value] : url.query) {
    if (key == "ttl") {
      settings.ttl = parse_seconds("ttl (etcd leases count whole seconds)", value, 1, 86400);
      // A fraction would be rounded up by the lease grant: refused, as the README promises.
      if (settings.ttl.count() % 1000 != 0) {
        throw InvalidUrl("ttl must be a whole number of seconds on etcd (its leases count whole seconds), got '" +
                         value + "'");
      }
    } else if (key == "cacert") {
      if (!settings.tls) throw InvalidUrl("cacert= needs etcds:// (TLS) in '" + url.text + "'");
      settings.root_certificates = read_file(value);
    } else {
      throw InvalidUrl("unknown parameter '" + key + "' in '" + url.text + "' (expected ttl or cacert)");
    }
  }
  if (options.ttl.count() > 0) {
    check_ttl_option(options.ttl, 1);  // etcd lease TTLs are whole seconds
    if (options.ttl.count() % 1000 != 0) {
      throw InvalidArgument("ttl must be a whole number of seconds on etcd (its leases count whole seconds), got " +
                            std::to_string(options.ttl.count()) + " ms");
    }
    settings.ttl = options.ttl;
  }
  return settings;
}

// --- Connection ----------------------------------------------------------------------------

Connection::Connection(Settings settings)
    : settings_(std::move(settings)), connect_by_(SteadyClock::now() + connect_timeout(settings_)) {
  enable_fork_support();
  [[maybe_unused]] const auto& kept = keep_event_engine_for_process();
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (settings_.tls) {
    grpc::SslCredentialsOptions tls;
    tls.pem_root_certs = settings_.root_certificates;
    credentials = grpc::SslCredentials(tls);
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  for (const auto& host : settings_.endpoints) {
    grpc::ChannelArguments arguments;
    // Reconnect quickly after a restart or fail-over: waiters and keep-alives depend on it.
    arguments.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, static_cast<int>(kReconnectFirst.count()));
    arguments.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, static_cast<int>(kReconnectFirst.count()));
    arguments.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, static_cast<int>(kReconnectLast.count()));
    // A connection of its own per client: gRPC otherwise shares one per target process-wide,
    // and a forked child would write into its parent's HTTP/2 stream.
    arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    Endpoint endpoint;
    endpoint.channel = grpc::CreateCustomChannel("dns:///" + host, credentials, arguments);
    endpoint.kv = pb::KV::NewStub(endpoint.channel);
    endpoint.lease = pb::Lease::NewStub(endpoint.channel);
    endpoint.watch = pb::Watch::NewStub(endpoint.channel);
    endpoint.auth = pb::Auth::NewStub(endpoint.channel);
    endpoint.key_watch_channel = grpc::CreateCustomChannel("dns:///" + host, credentials, arguments);
    endpoint.key_watch = pb::Watch::NewStub(endpoint.key_watch_channel);
    endpoints_.push_back(std::move(endpoint));
  }
  current_ = first_endpoint_that_may_answer(*endpoints_.front().channel, settings_, connect_by_);
  if (!settings_.user.empty()) authenticate(std::min(SteadyClock::now() + kConnectAuthentication, connect_by_));
  if (settings_.reports) settings_.reports->connected(false);
}

Connection::Endpoint& Connection::current() {
  std::lock_guard lock(mutex_);
  return endpoints_[current_];
}

pb::Watch::Stub& Connection::watch_stub() { return *current().watch; }

pb::Watch::Stub& Connection::key_watch_stub() { return *current().key_watch; }

void Connection::prepare(grpc::ClientContext& context, Deadline deadline, bool may_wait_for_connection) {
  if (closed_) throw BackendUnavailable("this etcd client was ended at process exit");
  if (deadline) context.set_deadline(system_deadline(*deadline));
  // Calls wait (within their deadlines) for the connection to be up rather than failing fast:
  // with only fail-fast calls, Debian's gRPC 1.51 was seen to shut down every new connection
  // attempt ("tcp handshaker shutdown"), both after an etcd restart and, now and then, when
  // several clients connected at once. Calls that must not be resent still fail fast: only a
  // fast failure to connect tells them they were never sent.
  if (may_wait_for_connection) context.set_wait_for_ready(true);
  std::lock_guard lock(mutex_);
  if (!token_.empty()) context.AddMetadata("token", token_);
}

namespace {

// `authenticating`: the status of an Authenticate call, which answers wrong credentials with
// INVALID_ARGUMENT.
Failure classify(const grpc::Status& status, bool authenticating = false) {
  switch (status.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT: return authenticating ? Failure::unauthenticated : Failure::failed;
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::CANCELLED:
    case grpc::StatusCode::INTERNAL: return Failure::transient;
    case grpc::StatusCode::UNAUTHENTICATED: return Failure::unauthenticated;
    case grpc::StatusCode::PERMISSION_DENIED: return Failure::refused;
    case grpc::StatusCode::NOT_FOUND:
      // etcd has no code of its own for this: its Go client also tells its errors by their
      // description (rpctypes.ErrLeaseNotFound).
      return status.error_message().find("lease not found") != std::string::npos ? Failure::lease_gone
                                                                                 : Failure::failed;
    default: return Failure::failed;
  }
}

// A transient failure of a call that was never sent (the connection could not be made): such a
// call may be resent even when it is not idempotent.
bool never_sent(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE &&
         status.error_message().find("connect") != std::string::npos;
}

}  // namespace

// The one place where a failed call's status becomes a turnstile exception. No user name nor
// password appears in a message.
void Connection::throw_error(Failure failure, const grpc::Status& status, std::string_view what,
                             std::string_view where) const {
  const auto detail = std::string(what) + ": " + describe(status);
  const std::string endpoints = where.empty() ? settings_.description : std::string(where);
  switch (failure) {
    case Failure::unauthenticated: throw AccessDenied("etcd refused " + detail);
    case Failure::refused: throw AccessDenied("etcd refused to this client's user " + detail);
    case Failure::lease_gone: throw LeaseGone("etcd no longer knows the lease of " + detail);
    case Failure::outcome_unknown: throw BackendUnavailable("etcd did not confirm (its outcome is unknown) " + detail);
    case Failure::transient: throw BackendUnavailable("no etcd at " + endpoints + " answered " + detail);
    case Failure::failed: break;
  }
  throw BackendUnavailable("etcd at " + endpoints + " failed " + detail);
}

void Connection::check_retryable(const grpc::Status& status, const char* what, SteadyClock::time_point deadline,
                                 std::size_t tried) {
  const auto failure = classify(status);
  switch (failure) {
    case Failure::transient: next_endpoint(tried); return;
    case Failure::unauthenticated:
      if (settings_.user.empty()) break;
      authenticate(std::max(deadline, SteadyClock::now() + kReauthenticateFloor));
      return;
    default: break;
  }
  throw_error(failure, status, what);
}

std::size_t Connection::current_index() {
  std::lock_guard lock(mutex_);
  return current_;
}

void Connection::next_endpoint(std::size_t from) {
  std::lock_guard lock(mutex_);
  if (from != kAnyEndpoint && from != current_) return;
  current_ = (current_ + 1) % endpoints_.size();
}

template <class Call>
void Connection::unary(Call call, const CallBudget& budget, Resend resend, const char* what, milliseconds attempt_cap) {
  const auto deadline = budget.deadline().value_or(budget.call_end(kEtcdTimes.call));
  const auto& stop = budget.stop();
  const bool idempotent = resend == Resend::allowed;
  auto pause = kRetryFirstPause;
  std::string tried_endpoints;  // for the message: only those the call went to
  for (;;) {
    if (stop.stop_requested()) throw CallStopped(std::string("stopped before ") + what + " was sent to etcd");
    grpc::ClientContext context;
    prepare(context, std::min(deadline, SteadyClock::now() + attempt_cap), idempotent);
    const auto tried = current_index();
    const auto& endpoint = settings_.endpoints.at(tried);
    if (("," + tried_endpoints + ",").find("," + endpoint + ",") == std::string::npos) {
      tried_endpoints += (tried_endpoints.empty() ? "" : ",") + endpoint;
    }
    grpc::Status status;
    {
      std::stop_callback cancel(stop, [&context] { context.TryCancel(); });
      GrpcScope scope;
      status = call(context);
    }
    if (status.ok()) return;
    if (stop.stop_requested()) {
      if (!idempotent && !never_sent(status)) throw_error(Failure::outcome_unknown, status, what);
      throw CallStopped(std::string("stopped while ") + what + " waited for etcd");
    }
    check_retryable(status, what, deadline, tried);
    if (!idempotent && !never_sent(status)) throw_error(Failure::outcome_unknown, status, what);
    if (SteadyClock::now() + pause >= deadline) throw_error(Failure::transient, status, what, tried_endpoints);
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, kRetryLastPause);
  }
}

void Connection::authenticate(SteadyClock::time_point deadline) {
  pb::AuthenticateRequest request;
  request.set_name(settings_.user);
  request.set_password(settings_.password);
  for (auto pause = kRetryFirstPause;; pause = std::min(pause * 2, kRetryLastPause)) {
    pb::AuthenticateResponse response;
    grpc::ClientContext context;
    context.set_deadline(system_deadline(std::min(deadline, SteadyClock::now() + kAttemptCap)));
    grpc::Status status;
    {
      GrpcScope scope;
      status = current().auth->Authenticate(&context, request, &response);
    }
    if (status.ok()) {
      std::lock_guard lock(mutex_);
      token_ = response.token();
      return;
    }
    // Authentication is not enabled: no token needed.
    if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION) return;
    const auto failure = classify(status, true);
    if (failure != Failure::transient || SteadyClock::now() + pause >= deadline) {
      throw_error(failure, status, "the client's credentials");
    }
    next_endpoint();
    std::this_thread::sleep_for(pause);
  }
}

pb::RangeResponse Connection::range(const pb::RangeRequest& request, const CallBudget& call) {
  pb::RangeResponse response;
  unary([&](grpc::ClientContext& context) { return current().kv->Range(&context, request, &response); }, call,
        Resend::allowed, "a read");
  return response;
}

pb::TxnResponse Connection::txn(const pb::TxnRequest& request, const CallBudget& call, Resend resend,
                                milliseconds attempt_cap) {
  pb::TxnResponse response;
  unary([&](grpc::ClientContext& context) { return current().kv->Txn(&context, request, &response); }, call, resend,
        "a transaction", attempt_cap);
  return response;
}

pb::LeaseGrantResponse Connection::lease_grant(std::int64_t ttl_seconds, const CallBudget& call) {
  pb::LeaseGrantRequest request;
  request.set_ttl(ttl_seconds);
  pb::LeaseGrantResponse response;
  // Not idempotent, but a lease granted twice only costs an unused lease that expires.
  unary([&](grpc::ClientContext& context) { return current().lease->LeaseGrant(&context, request, &response); }, call,
        Resend::allowed, "a lease grant");
  if (!response.error().empty()) throw BackendUnavailable("etcd refused a lease: " + response.error());
  return response;
}

void Connection::lease_revoke(std::int64_t lease, const CallBudget& call) {
  pb::LeaseRevokeRequest request;
  request.set_id(lease);
  pb::LeaseRevokeResponse response;
  // Resent safely: a second revoke finds the lease gone (LeaseGone), which is the goal.
  unary([&](grpc::ClientContext& context) { return current().lease->LeaseRevoke(&context, request, &response); }, call,
        Resend::allowed, "a lease revoke");
}

std::uint64_t Connection::linearizable_term(const std::string& key, const CallBudget& call) {
  pb::RangeRequest request;
  request.set_key(key);  // only the read's header matters
  request.set_count_only(true);
  return range(request, call).header().raft_term();
}

Connection::KeepAliveAnswer Connection::keep_alive(std::int64_t lease, SteadyClock::time_point deadline) {
  grpc::ClientContext context;
  prepare(context, deadline);
  GrpcScope scope(&context);
  const auto tried = current_index();
  auto stream = current().lease->LeaseKeepAlive(&context);
  pb::LeaseKeepAliveRequest request;
  request.set_id(lease);
  pb::LeaseKeepAliveResponse response;
  const bool answered = stream->Write(request) && stream->Read(&response);
  stream->WritesDone();
  context.TryCancel();  // one round per stream: do not wait for the server to close it
  const auto status = stream->Finish();
  if (answered) return {response.ttl(), response.header().raft_term()};
  check_retryable(status, "a lease keep-alive", deadline, tried);
  throw_error(Failure::transient, status, "a lease keep-alive");
}

// --- WatchStream ---------------------------------------------------------------------------

WatchStream::WatchStream(Connection& connection, Deadline deadline) : connection_(connection), scope_(&context_) {
  connection.prepare(context_, deadline);
}

void WatchStream::start(const pb::WatchCreateRequest& request) {
  stream_ = connection_.watch_stub().Watch(&context_);
  pb::WatchRequest create;
  *create.mutable_create_request() = request;
  pb::WatchResponse response;
  if (!stream_->Write(create)) return;  // next() then reports the end
  // etcd confirms with `created` before any event; a cancelled watch (compacted revision)
  // ends at once.
  if (!stream_->Read(&response) || !response.created() || response.canceled()) context_.TryCancel();
}

WatchStream::~WatchStream() {
  context_.TryCancel();
  if (stream_) stream_->Finish();
}

bool WatchStream::next(pb::WatchResponse& response) {
  if (!stream_) return false;
  while (stream_->Read(&response)) {
    if (response.canceled() || response.compact_revision() != 0) return false;
    if (response.events_size() > 0) return true;
  }
  return false;
}

}  // namespace turnstile::detail::etcd
