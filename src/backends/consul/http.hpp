// SPDX-License-Identifier: Apache-2.0
// Consul's HTTP API over libcurl (http.cpp): kept-alive connections in a small pool of handles,
// a deadline on every call, stop tokens that end a call at once, close-on-exec
// sockets, the ACL token in a header only, and the one place where answers become errors.
// Several requests may run at once (call_each, on libcurl's multi interface): renewals of many
// sessions. Blocking queries run on the client's I/O thread instead (blocking_queries.hpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <vector>

#include "core/telemetry.hpp"

namespace turnstile::detail::consul {

struct Endpoint {
  std::string base;    // http://host:port or https://host:port
  std::string token;   // X-Consul-Token; never shown
  std::string cacert;  // consuls://: a CA bundle file (empty: the system's)
  std::string dc;      // ?dc= on every request (empty: the agent's own)
  std::string shown;   // the redacted URL, for messages
  // Where the connections curl opens and the session renewals are reported (the client's, set
  // by the factory; it outlives the backend). None in tools and tests.
  BackendReports* reports = nullptr;
};

struct Reply {
  long status = 0;
  std::string body;
  std::uint64_t index = 0;  // X-Consul-Index (0: none)
};

struct Request {
  std::string method;
  std::string path;  // starts with /v1/, may carry a query
  std::string body;
};

// What became of one request of call_each.
struct Outcome {
  std::optional<Reply> reply;  // none: no answer (error says why)
  std::string error;
  bool stopped = false;                                 // the stop ended it before an answer
  std::chrono::steady_clock::time_point sent_at{};      // when it was started (unset: never sent)
  std::chrono::steady_clock::time_point answered_at{};  // when its answer (or failure) came
};

class Http {
 public:
  explicit Http(Endpoint endpoint);
  ~Http();
  Http(const Http&) = delete;
  Http& operator=(const Http&) = delete;

  // One request; `path` starts with /v1/ and may carry a query. Answers any HTTP status;
  // throws BackendUnavailable when no answer came within `timeout` (none when it is zero: not
  // sent), or `stop` was requested (then `stopped` is set instead of throwing, when given).
  Reply call(const char* method, const std::string& path, const std::string& body, std::chrono::milliseconds timeout,
             const std::stop_token& stop = {}, bool* stopped = nullptr);

  // `requests` at once, each on a connection of its own, at most `parallel` at a time (the rest
  // start as others end); each gets `timeout` from when it starts, and none starts or runs past
  // `until`. A stop ends it at once. Throws nothing for a request that got no answer: its Outcome says so.
  std::vector<Outcome> call_each(const std::vector<Request>& requests, std::size_t parallel,
                                 std::chrono::milliseconds timeout, std::chrono::steady_clock::time_point until,
                                 const std::stop_token& stop = {});

  const Endpoint& endpoint() const { return endpoint_; }

 private:
  struct Handle;
  std::unique_ptr<Handle> take();
  void give_back(std::unique_ptr<Handle> handle);

  Endpoint endpoint_;
  std::mutex mutex_;
  std::vector<std::unique_ptr<Handle>> spare_;  // idle handles with their open connections
};

}  // namespace turnstile::detail::consul
