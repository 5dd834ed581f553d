// SPDX-License-Identifier: Apache-2.0
// A Client's counters and histograms (relaxed atomics in fixed arrays: no lock on the hot path
// unless the name label is on) and its event hook; Client::metrics() copies them out.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "core/event_queue.hpp"
#include "core/queue.hpp"
#include "turnstile/client.hpp"
#include "turnstile/metrics.hpp"

namespace turnstile::detail {

enum class AcquireOutcome : std::uint8_t { admitted, timed_out, stopped, failed };
inline constexpr std::size_t kAcquireOutcomes = 4;
// Why a hold was lost: its loss deadline passed without a confirmed renewal (the loss rule);
// its session or lease ended on the server; its entry was gone (expired, deleted, its state
// file replaced); the server it was on stopped being the primary; anything else.
enum class LossCause : std::uint8_t { renewal_timeout, session_expired, entry_gone, failover, other };
inline constexpr std::size_t kLossCauses = 5;
// Why a hold was suspended: the connection to the server was lost; a renewal got no answer (or
// an error); the server that renewed it may no longer lead its cluster.
enum class SuspendCause : std::uint8_t { connection_lost, renewal_unanswered, leader_changed };
inline constexpr std::size_t kSuspendCauses = 3;
// Primitive's values, then the PermitCounter's acquires (which take no hold).
inline constexpr std::size_t kPermitCounter = 5;
inline constexpr std::size_t kMeteredPrimitives = 6;
constexpr std::size_t metered(Primitive primitive) { return static_cast<std::size_t>(primitive); }

const char* to_string(AcquireOutcome outcome) noexcept;
const char* to_string(LossCause cause) noexcept;
const char* to_string(SuspendCause cause) noexcept;
const char* metered_primitive_name(std::size_t index) noexcept;

// Histogram bucket upper bounds, in nanoseconds (Prometheus' `le`, in seconds, when rendered).
template <std::size_t N>
using Bounds = std::array<std::int64_t, N>;
inline constexpr Bounds<14> kWaitBounds{100'000,        500'000,        1'000'000,      5'000'000,      10'000'000,
                                        50'000'000,     100'000'000,    500'000'000,    1'000'000'000,  5'000'000'000,
                                        10'000'000'000, 30'000'000'000, 60'000'000'000, 300'000'000'000};
inline constexpr Bounds<10> kHoldBounds{1'000'000,         10'000'000,        100'000'000,     1'000'000'000,
                                        10'000'000'000,    60'000'000'000,    300'000'000'000, 900'000'000'000,
                                        3'600'000'000'000, 86'400'000'000'000};
inline constexpr Bounds<12> kRoundTripBounds{500'000,     1'000'000,   2'500'000,     5'000'000,
                                             10'000'000,  25'000'000,  50'000'000,    100'000'000,
                                             250'000'000, 500'000'000, 1'000'000'000, 2'500'000'000};

// One histogram's cells: a count per bucket (the last one +Inf) and the sum in nanoseconds.
template <auto Upper>
class HistogramCells {
 public:
  void observe(std::chrono::nanoseconds elapsed) noexcept {
    const auto ns = elapsed.count() < 0 ? 0 : elapsed.count();
    std::size_t bucket = 0;
    while (bucket < Upper.size() && ns > Upper[bucket]) ++bucket;
    counts_[bucket].fetch_add(1, std::memory_order_relaxed);
    sum_ns_.fetch_add(static_cast<std::uint64_t>(ns), std::memory_order_relaxed);
  }
  Metrics::Histogram read() const;

 private:
  std::array<std::atomic<std::uint64_t>, Upper.size() + 1> counts_{};
  std::atomic<std::uint64_t> sum_ns_{0};
};

using Counter = std::atomic<std::uint64_t>;
inline void count(Counter& counter) noexcept { counter.fetch_add(1, std::memory_order_relaxed); }

// What is counted per primitive (and per name, with the name label).
struct PrimitiveCells {
  std::array<HistogramCells<kWaitBounds>, kAcquireOutcomes> wait;
  HistogramCells<kHoldBounds> hold;
  std::array<Counter, kLossCauses> lost{};
  std::array<Counter, kSuspendCauses> suspended{};
};
using NameCells = std::array<PrimitiveCells, kMeteredPrimitives>;

class Telemetry;

// What a backend reports about its own session or lease and connections: one per client,
// reachable from the backend's factory. file:// reports nothing (no renewals, no connections).
class BackendReports {
 public:
  explicit BackendReports(Telemetry& telemetry) : telemetry_(telemetry) {}
  // A renewal (keep-alive, TTL refresh, session renewal) was confirmed `round_trip` after it
  // was sent.
  void renewed(std::chrono::nanoseconds round_trip) noexcept;
  // A renewal failed or got no answer in time: `reason` says which (no credentials in it).
  void renewal_failed(const std::string& reason) noexcept;
  // A connection to a server was made; `replacing_lost`: it replaces one that was lost.
  void connected(bool replacing_lost) noexcept;
  // connected() for a backend that opens a connection only when it has none left: its first is
  // a connection, every later one a reconnect.
  void opened_another() noexcept;

 private:
  friend class Telemetry;
  Telemetry& telemetry_;
  HistogramCells<kRoundTripBounds> round_trip_;
  Counter renewal_failures_{0};
  Counter connections_{0};
  Counter reconnects_{0};
};

class Telemetry {
 public:
  // `backend`: the backend's family ("file", "redis", "zookeeper", "etcd", "consul").
  Telemetry(std::string backend, bool name_label, EventHandler on_event);
  ~Telemetry();
  Telemetry(const Telemetry&) = delete;
  Telemetry& operator=(const Telemetry&) = delete;

  const std::string& backend() const { return backend_; }
  // The cells of `primitive` (a metered() index) for `name`: the shared ones unless the name
  // label is on (then a lookup under a lock; past kMaxNames names, the "other" ones).
  PrimitiveCells& cells(const std::string& name, std::size_t primitive);
  bool tells_events() const noexcept { return static_cast<bool>(on_event_); }
  // An event about a hold or acquire (the client's own: primitive kMeteredPrimitives, no name).
  static Event event(EventKind kind, std::size_t primitive = kMeteredPrimitives, const std::string& name = {},
                     std::uint64_t token = 0);
  // Stamps the time and backend and hands the event to the hook's own thread (EventQueue), if
  // there is a hook; never throws, never waits for the hook.
  void tell(Event event) const noexcept;
  BackendReports& backend_reports() { return reports_; }
  // Returns once every event told so far reached the hook (tests).
  void wait_until_events_told() const {
    if (events_) events_->wait_until_told();
  }
  // The end of an acquire that started at `started` (its wait), told as an event when asked.
  void acquire_ended(PrimitiveCells& cells, std::size_t primitive, const std::string& name, AcquireOutcome outcome,
                     SteadyClock::time_point started, SteadyClock::time_point ended, std::uint64_t token = 0,
                     const std::string& error = {}) noexcept;
  // A failed release that was tried again in the background.
  void removal_retried() noexcept { count(removal_retries_); }
  Metrics snapshot(std::size_t removals_pending) const;

  static constexpr std::size_t kMaxNames = 1000;
  // Where names past the cap are counted: a value no name can be (names never start with '/').
  static constexpr const char* kOtherName = "/other";

 private:
  Metrics::Family hold_family(const char* name, const char* help, bool wait) const;
  Metrics::Family cause_family(const char* name, const char* help, bool lost) const;
  Metrics::Labels labels(const std::string* name, std::size_t primitive) const;
  template <class Each>
  void each_name(Each each) const;

  std::string backend_;
  bool name_label_;
  EventHandler on_event_;
  std::unique_ptr<EventQueue> events_;  // made when there is a hook
  NameCells unnamed_;
  mutable std::mutex names_mutex_;  // the name label's only
  std::unordered_map<std::string, std::unique_ptr<NameCells>> names_;
  Counter removal_retries_{0};
  BackendReports reports_{*this};
};

}  // namespace turnstile::detail
