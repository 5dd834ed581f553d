// SPDX-License-Identifier: Apache-2.0
// Late requests for the conformance suite (late_test.cpp): a client whose connections pass
// through test proxies (tests/support/tcp_proxy.hpp), and, per backend, which bytes of its
// requests identify the write under test.
#pragma once

#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <turnstile/turnstile.hpp>

#include "support/tcp_proxy.hpp"

namespace conformance {

// Which client-to-server bytes identify a backend's write (the nth chunk containing them,
// counted from the moment the hold is armed), with the test client's holder label in them.
struct LatePatterns {
  std::string join;  // the request creating a queue entry (Mutex, Semaphore)
  int join_nth = 1;
  std::string lease;  // the write that makes an uncontended Semaphore lease (or reader) held
  int lease_nth = 1;
  std::string line;  // PermitCounter::acquire's place in line, when too few permits are free
  int line_nth = 1;
  std::string take;  // PermitCounter::acquire's take of permits that are free
  int take_nth = 1;
  std::string add;  // PermitCounter::add_permits' change
  int add_nth = 1;
  // A copy of one request can be sent again on a new connection, as a client's resend would
  // (RESP and HTTP/1.1). Not over HTTP/2 (etcd) or a ZooKeeper session: there the add is held
  // and delivered after later changes instead.
  bool replays = false;
  // The connection belongs to a session (ZooKeeper): a late request is delivered only once the
  // client has given up the stalled connection and reconnected, as it would after a partition.
  bool session_bound = false;
};

// The table: `label` is the test client's holder label, `counter` the PermitCounter's name.
LatePatterns late_patterns(const std::string& url, const std::string& label, const std::string& counter);

// How a request that writes `value` (an election's proclaim) carries it on the wire of `url`'s
// backend, for a pattern: as it is, or base64-encoded in Consul's /v1/txn bodies.
std::string late_value_pattern(const std::string& url, const std::string& value);

// Why the late-request tests cannot run on `url` (empty when they can).
std::string late_skip_reason(const std::string& url);

// A client whose every connection goes through proxies in front of `url`'s server: one, or two
// for etcd, whose client then fails over from a held connection to the other endpoint as it
// would in a cluster.
class LateRig {
 public:
  LateRig(const std::string& url, turnstile::ClientOptions options);
  turnstile::Client& client() { return *client_; }
  // Connections accepted by the proxies so far.
  std::uint64_t accepted() const;

  // One hold armed on every proxy: the first to hold keeps it, the others are disarmed then.
  class Hold {
   public:
    // Polls until one proxy holds (true) or `timeout` passes.
    bool wait_held(std::chrono::milliseconds timeout);
    // Resets the client's side of the held connection (HeldRequest::cut_client).
    void cut_client();
    void deliver();

   private:
    friend class LateRig;
    std::vector<std::shared_ptr<turnstile_test::HeldRequest>> armed_;
    std::shared_ptr<turnstile_test::HeldRequest> caught_;
  };
  Hold hold(const std::string& pattern, int nth);
  // A copy taken on every proxy; the one that saw it is replayed.
  class Copy {
   public:
    bool wait_seen(std::chrono::milliseconds timeout);
    void replay();

   private:
    friend class LateRig;
    std::vector<std::shared_ptr<turnstile_test::DuplicatedRequest>> armed_;
    std::shared_ptr<turnstile_test::DuplicatedRequest> seen_;
  };
  Copy duplicate(const std::string& pattern, int nth);

 private:
  std::vector<std::unique_ptr<turnstile_test::TcpProxy>> proxies_;
  std::optional<turnstile::Client> client_;
};

// What a call that may fail came to.
struct Outcome {
  bool succeeded = false;
  std::string error;  // what it threw, if it did
};
// Runs `call` on another thread (so that a hold can be watched meanwhile).
std::future<Outcome> attempt(std::function<bool()> call);

// True as soon as `seen` holds, polled every 50 ms for `window`: a late write landing.
bool shows_within(const std::function<bool()>& seen, std::chrono::milliseconds window);

// A holder label unique to this process and call ("late-<pid>-<n>").
std::string unique_label();

}  // namespace conformance
