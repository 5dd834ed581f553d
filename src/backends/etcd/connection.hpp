// SPDX-License-Identifier: Apache-2.0
// The etcd v3 API over gRPC (Debian's libgrpc++): endpoints with fail-over, etcd
// authentication, retries of idempotent calls, watch and keep-alive streams, and the fork
// handling gRPC needs so that a forked child can open its own client.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <stop_token>
#include <string>
#include <string_view>
#include <vector>

#include "backends/etcd/timeouts.hpp"
#include "core/backend.hpp"
#include "core/call_budget.hpp"
#include "rpc.grpc.pb.h"

namespace turnstile::detail::etcd {

namespace pb = etcdserverpb;

// etcd answered that a lease is unknown (expired or revoked): every key written with it is
// gone, and a request that writes with it was not applied.
class LeaseGone : public BackendUnavailable {
 public:
  using BackendUnavailable::BackendUnavailable;
};

// The caller's stop token ended a call: one not sent yet, or an idempotent one (a write may
// then have been applied: its caller cleans up as after any BackendUnavailable). A stopped
// call that is not idempotent and may have been sent is outcome_unknown instead.
class CallStopped : public BackendUnavailable {
 public:
  using BackendUnavailable::BackendUnavailable;
};

// What a failed call's status means (Connection::throw_error makes it an exception).
enum class Failure {
  transient,        // no answer (yet): worth resending, to the next endpoint
  outcome_unknown,  // no answer to a call that may have been applied: not resent
  unauthenticated,  // the auth token expired or was revoked, or the credentials are wrong
  refused,          // not allowed to this client's user
  lease_gone,       // the call's lease does not exist (expired or revoked)
  failed,           // anything else etcd said
};

// Whether a call may be sent again after a failure that leaves its outcome unknown.
enum class Resend {
  allowed,  // idempotent: resent (to the next endpoint) until the call's end
  never,    // BackendUnavailable (outcome unknown) at once
};

struct Settings {
  std::string description;             // the endpoints as written, for messages
  std::vector<std::string> endpoints;  // host:port
  bool tls = false;
  std::string root_certificates;  // PEM from ?cacert=, empty: the system's
  std::string user;
  std::string password;
  std::chrono::milliseconds ttl{10'000};  // etcdctl lock's default
  std::string holder_label;               // ClientOptions::holder_label, kept in our entries
  // Client::connect's bound, from ClientOptions::connect_timeout (0: kEtcdTimes.call.cap).
  std::chrono::milliseconds connect_timeout{0};
  // Where the client's connection and lease keep-alives are reported (the client's, set by the
  // factory; it outlives the backend). None in tools and tests.
  BackendReports* reports = nullptr;
};

// etcd[s]://[user:password@]host:port[,host:port...][?ttl=SECONDS][&cacert=PATH];
// ClientOptions::ttl wins when set. Throws InvalidUrl, InvalidArgument.
Settings parse_settings(const BackendUrl& url, const ClientOptions& options);

// How long Client::connect may take: the settings' connect_timeout, else kEtcdTimes.call.cap.
milliseconds connect_timeout(const Settings& settings);

// The key range [key, prefix_end(key)) holds every key starting with `key`.
std::string prefix_end(std::string key);

// Marks a stretch of code that calls into gRPC. fork() waits (bounded) until no such stretch
// is running and cancels registered streams first, so that gRPC's own fork handling
// (grpc_prefork/grpc_postfork_*, which refuses to run while calls are in flight) can leave
// the child a working gRPC. Streams cancelled that way end like a broken connection.
class GrpcScope {
 public:
  explicit GrpcScope(grpc::ClientContext* stream_context = nullptr);
  ~GrpcScope();
  GrpcScope(const GrpcScope&) = delete;
  GrpcScope& operator=(const GrpcScope&) = delete;

 private:
  grpc::ClientContext* stream_context_;
};

class Connection;

// One Watch stream watching one key or prefix from a revision.
class WatchStream {
 public:
  // Prepares the stream; start() opens it.
  WatchStream(Connection& connection, Deadline deadline);
  ~WatchStream();
  // Opens the stream and waits (until the deadline or cancel()) for etcd to confirm the watch.
  // When it fails, next() reports the end.
  void start(const pb::WatchCreateRequest& request);
  // The next response with events; false when the stream ended (deadline, cancel(), a
  // broken connection, a compacted start revision): the caller looks again.
  bool next(pb::WatchResponse& response);
  // From any thread: makes next() return false.
  void cancel() { context_.TryCancel(); }

 private:
  Connection& connection_;
  grpc::ClientContext context_;
  GrpcScope scope_;
  std::unique_ptr<grpc::ClientReaderWriter<pb::WatchRequest, pb::WatchResponse>> stream_;
};

class Connection {
 public:
  // Connects (lazily, as gRPC does) and authenticates when a user is given (the backend's
  // first lease grant checks that an etcd answers). Throws BackendUnavailable, AccessDenied.
  explicit Connection(Settings settings);
  // When connecting (authenticating, the first lease grant) must be over: connect_timeout
  // from when this connection was made.
  SteadyClock::time_point connect_by() const { return connect_by_; }

  const Settings& settings() const { return settings_; }
  // From now on every call fails at once with BackendUnavailable (the client ended at exit).
  void close() { closed_ = true; }

  // A call ends by its budget's deadline (callers clamp theirs with CallBudget::for_call; none:
  // kEtcdTimes.call.cap from now), then BackendUnavailable. Its stop cancels it (CallStopped,
  // unless a write's outcome is unknown). Reads and lease calls may always be resent.
  pb::RangeResponse range(const pb::RangeRequest& request, const CallBudget& call = {});
  // `attempt_cap`: how long one endpoint is tried before the next (kAttemptCap unless given).
  pb::TxnResponse txn(const pb::TxnRequest& request, const CallBudget& call, Resend resend,
                      milliseconds attempt_cap = kAttemptCap);
  pb::LeaseGrantResponse lease_grant(std::int64_t ttl_seconds, const CallBudget& call);
  // Throws LeaseGone when the lease is already gone, BackendUnavailable when etcd did not answer.
  void lease_revoke(std::int64_t lease, const CallBudget& call);
  // One keep-alive round on a LeaseKeepAlive stream: the lease's remaining TTL in seconds
  // (<= 0 when etcd no longer knows the lease) and the Raft term of the server that answered.
  // Throws BackendUnavailable.
  struct KeepAliveAnswer {
    std::int64_t ttl = 0;
    std::uint64_t raft_term = 0;
  };
  KeepAliveAnswer keep_alive(std::int64_t lease, SteadyClock::time_point deadline);
  // The Raft term a linearizable read of `key` is served in now: a leader serves it only once a
  // quorum confirmed it still leads. Throws BackendUnavailable (AccessDenied without read
  // permission on `key`).
  std::uint64_t linearizable_term(const std::string& key, const CallBudget& call);

  // For WatchStream: a context with the auth token and deadline, and the current endpoint.
  // `may_wait_for_connection`: the call waits for the connection to be up (within its
  // deadline) instead of failing fast.
  void prepare(grpc::ClientContext& context, Deadline deadline, bool may_wait_for_connection = true);
  pb::Watch::Stub& watch_stub();
  // The held keys' watch: a connection of its own (made when first used), so that the thread
  // reading that long-lived stream never polls, reads and hands over the replies of other calls.
  pb::Watch::Stub& key_watch_stub();
  // After a failed call: the status as an exception, or nothing when it is worth retrying
  // (the endpoint then moves on from `tried`, the one the call went to, unless another call
  // moved it already). A re-authentication it needs ends by `deadline`. Throws LeaseGone when
  // etcd said the call's lease does not exist.
  static constexpr std::size_t kAnyEndpoint = static_cast<std::size_t>(-1);
  void check_retryable(const grpc::Status& status, const char* what, SteadyClock::time_point deadline,
                       std::size_t tried = kAnyEndpoint);
  // The one place where a failed call's status becomes a turnstile exception. `where`: the
  // endpoints the call went to (empty: all of them).
  [[noreturn]] void throw_error(Failure failure, const grpc::Status& status, std::string_view what,
                                std::string_view where = {}) const;

 private:
  struct Endpoint {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<pb::KV::Stub> kv;
    std::unique_ptr<pb::Lease::Stub> lease;
    std::unique_ptr<pb::Watch::Stub> watch;
    std::unique_ptr<pb::Auth::Stub> auth;
    std::shared_ptr<grpc::Channel> key_watch_channel;
    std::unique_ptr<pb::Watch::Stub> key_watch;
  };

  template <class Call>
  void unary(Call call, const CallBudget& budget, Resend resend, const char* what,
             milliseconds attempt_cap = kAttemptCap);
  Endpoint& current();
  std::size_t current_index();
  void authenticate(SteadyClock::time_point deadline);
  // Two calls that fail on one endpoint at once move on by one endpoint, not two (which would
  // send both back to the endpoint that just failed them).
  void next_endpoint(std::size_t from = kAnyEndpoint);

  Settings settings_;
  SteadyClock::time_point connect_by_;
  std::vector<Endpoint> endpoints_;
  std::mutex mutex_;
  std::size_t current_ = 0;
  std::string token_;
  std::atomic<bool> closed_{false};
};

}  // namespace turnstile::detail::etcd
