// SPDX-License-Identifier: Apache-2.0
// A Client's counters, histograms and event hook (telemetry.hpp).
#include "core/telemetry.hpp"

#include <algorithm>
#include <vector>

namespace turnstile::detail {

const char* to_string(AcquireOutcome outcome) noexcept {
  switch (outcome) {
    case AcquireOutcome::admitted: return "admitted";
    case AcquireOutcome::timed_out: return "timed_out";
    case AcquireOutcome::stopped: return "stopped";
    case AcquireOutcome::failed: return "failed";
  }
  return "unknown";
}

const char* to_string(LossCause cause) noexcept {
  switch (cause) {
    case LossCause::renewal_timeout: return "renewal_timeout";
    case LossCause::session_expired: return "session_expired";
    case LossCause::entry_gone: return "entry_gone";
    case LossCause::failover: return "failover";
    case LossCause::other: return "other";
  }
  return "unknown";
}

const char* to_string(SuspendCause cause) noexcept {
  switch (cause) {
    case SuspendCause::connection_lost: return "connection_lost";
    case SuspendCause::renewal_unanswered: return "renewal_unanswered";
    case SuspendCause::leader_changed: return "leader_changed";
  }
  return "unknown";
}

const char* metered_primitive_name(std::size_t index) noexcept {
  static constexpr std::array<const char*, kMeteredPrimitives> kNames{"mutex",     "recursive_mutex", "shared_mutex",
                                                                      "semaphore", "election",        "permit_counter"};
  return index < kNames.size() ? kNames[index] : "unknown";
}

template <auto Upper>
Metrics::Histogram HistogramCells<Upper>::read() const {
  Metrics::Histogram histogram;
  for (const auto bound : Upper) histogram.upper_bounds.push_back(static_cast<double>(bound) / 1e9);
  for (const auto& cell : counts_) histogram.counts.push_back(cell.load(std::memory_order_relaxed));
  histogram.sum = static_cast<double>(sum_ns_.load(std::memory_order_relaxed)) / 1e9;
  return histogram;
}

// Made here for every histogram of a client (and visible to the tests through the header).
template class HistogramCells<kWaitBounds>;
template class HistogramCells<kHoldBounds>;
template class HistogramCells<kRoundTripBounds>;

void BackendReports::renewed(std::chrono::nanoseconds round_trip) noexcept {
  round_trip_.observe(round_trip);
  if (!telemetry_.tells_events()) return;
  auto event = Telemetry::event(EventKind::renewed);
  event.duration = round_trip;
  telemetry_.tell(std::move(event));
}

void BackendReports::renewal_failed(const std::string& reason) noexcept {
  count(renewal_failures_);
  if (!telemetry_.tells_events()) return;
  try {
    auto event = Telemetry::event(EventKind::renewal_failed);
    event.reason = reason;
    telemetry_.tell(std::move(event));
  } catch (...) {  // the event's copy of the reason could not be made: nothing told
  }
}

void BackendReports::connected(bool replacing_lost) noexcept {
  count(connections_);
  if (replacing_lost) count(reconnects_);
  if (telemetry_.tells_events()) {
    telemetry_.tell(Telemetry::event(replacing_lost ? EventKind::reconnected : EventKind::connected));
  }
}

void BackendReports::opened_another() noexcept { connected(connections_.load(std::memory_order_relaxed) > 0); }

Telemetry::Telemetry(std::string backend, bool name_label, EventHandler on_event)
    : backend_(std::move(backend)), name_label_(name_label), on_event_(std::move(on_event)),
      events_(on_event_ ? std::make_unique<EventQueue>(on_event_) : nullptr) {}

Telemetry::~Telemetry() {
  // In a child of fork() the event queue is left behind, never destroyed (EventQueue::forked);
  // kept reachable, so that a leak checker does not count it.
  if (events_ && events_->forked()) {
    static auto* left_behind = new std::vector<EventQueue*>;
    left_behind->push_back(events_.release());
  }
}

PrimitiveCells& Telemetry::cells(const std::string& name, std::size_t primitive) {
  if (!name_label_) return unnamed_[primitive];
  std::lock_guard lock(names_mutex_);
  auto found = names_.find(name);
  if (found == names_.end()) {
    // Past the cap every new name shares the "/other" cells (made once, not counted in the cap).
    const bool capped = names_.size() >= kMaxNames + (names_.contains(kOtherName) ? 1 : 0);
    const std::string key = capped ? std::string(kOtherName) : name;
    found = names_.find(key);
    if (found == names_.end()) found = names_.emplace(key, std::make_unique<NameCells>()).first;
  }
  return (*found->second)[primitive];
}

void Telemetry::tell(Event event) const noexcept {
  if (!events_) return;
  try {
    event.time = std::chrono::system_clock::now();
    event.backend = backend_;
  } catch (...) {  // no memory for the backend's name: told without it
  }
  events_->push(std::move(event));
}

void Telemetry::acquire_ended(PrimitiveCells& cells, std::size_t primitive, const std::string& name,
                              AcquireOutcome outcome, SteadyClock::time_point started, SteadyClock::time_point ended,
                              std::uint64_t token, const std::string& error) noexcept {
  const auto waited = std::chrono::duration_cast<std::chrono::nanoseconds>(ended - started);
  cells.wait[static_cast<std::size_t>(outcome)].observe(waited);
  if (!tells_events()) return;
  try {
    auto event = Telemetry::event(outcome == AcquireOutcome::admitted ? EventKind::acquired : EventKind::not_acquired,
                                  primitive, name, token);
    event.outcome = to_string(outcome);
    event.reason = error;
    event.duration = waited;
    tell(std::move(event));
  } catch (...) {
  }
}

Event Telemetry::event(EventKind kind, std::size_t primitive, const std::string& name, std::uint64_t token) {
  Event event;
  event.kind = kind;
  if (primitive < kMeteredPrimitives) event.primitive = metered_primitive_name(primitive);
  event.name = name;
  event.fencing_token = token;
  return event;
}

namespace {

bool used(const PrimitiveCells& cells) {
  return std::any_of(cells.wait.begin(), cells.wait.end(), [](const auto& wait) { return wait.read().count() > 0; });
}

Metrics::Series plain(Metrics::Labels labels, double value) {
  return Metrics::Series{.labels = std::move(labels), .value = value, .histogram = {}};
}

Metrics::Series histogram(Metrics::Labels labels, Metrics::Histogram histogram) {
  return Metrics::Series{.labels = std::move(labels), .value = 0, .histogram = std::move(histogram)};
}

}  // namespace

// Names in byte order (a stable rendering); the shared cells alone without the name label.
template <class Each>
void Telemetry::each_name(Each each) const {
  if (!name_label_) return each(static_cast<const std::string*>(nullptr), unnamed_);
  std::lock_guard lock(names_mutex_);
  std::vector<const std::string*> sorted;
  for (const auto& [name, cells] : names_) sorted.push_back(&name);
  std::sort(sorted.begin(), sorted.end(), [](const auto* a, const auto* b) { return *a < *b; });
  for (const auto* name : sorted) each(name, *names_.at(*name));
}

Metrics::Labels Telemetry::labels(const std::string* name, std::size_t primitive) const {
  Metrics::Labels labels{{"backend", backend_}, {"primitive", metered_primitive_name(primitive)}};
  if (name) labels.emplace_back("name", *name);
  return labels;
}

// The acquires' waits by outcome (`wait`), else the holds' times, of every primitive in use.
Metrics::Family Telemetry::hold_family(const char* name, const char* help, bool wait) const {
  Metrics::Family family{.name = name, .help = help, .type = Metrics::Type::histogram, .series = {}};
  each_name([&](const std::string* label, const NameCells& cells) {
    for (std::size_t primitive = 0; primitive < kMeteredPrimitives; ++primitive) {
      const auto& these = cells[primitive];
      if (!used(these) || (!wait && primitive == kPermitCounter)) continue;
      if (!wait) {
        family.series.push_back(histogram(labels(label, primitive), these.hold.read()));
        continue;
      }
      for (std::size_t outcome = 0; outcome < kAcquireOutcomes; ++outcome) {
        auto series_labels = labels(label, primitive);
        series_labels.emplace_back("outcome", to_string(static_cast<AcquireOutcome>(outcome)));
        family.series.push_back(histogram(std::move(series_labels), these.wait[outcome].read()));
      }
    }
  });
  return family;
}

// Suspensions or losses (`lost`) by cause, of every primitive that holds and is in use.
Metrics::Family Telemetry::cause_family(const char* name, const char* help, bool lost) const {
  Metrics::Family family{.name = name, .help = help, .type = Metrics::Type::counter, .series = {}};
  each_name([&](const std::string* label, const NameCells& cells) {
    for (std::size_t primitive = 0; primitive < kPermitCounter; ++primitive) {
      const auto& these = cells[primitive];
      if (!used(these)) continue;
      for (std::size_t cause = 0; cause < (lost ? kLossCauses : kSuspendCauses); ++cause) {
        auto series_labels = labels(label, primitive);
        series_labels.emplace_back(
            "cause", lost ? to_string(static_cast<LossCause>(cause)) : to_string(static_cast<SuspendCause>(cause)));
        const auto value = (lost ? these.lost[cause] : these.suspended[cause]).load(std::memory_order_relaxed);
        family.series.push_back(plain(std::move(series_labels), static_cast<double>(value)));
      }
    }
  });
  return family;
}

namespace {

// Holds admitted and not released yet, per series of `held`: its admissions (in `waited`) less
// its ends.
Metrics::Family holds_gauge(const Metrics::Family& held, const Metrics::Family& waited) {
  Metrics::Family holding{.name = "turnstile_holds",
                          .help = "Holds admitted and not released yet (lost ones included until released).",
                          .type = Metrics::Type::gauge,
                          .series = {}};
  for (const auto& series : held.series) {
    Metrics::Labels match = series.labels;
    double admitted = 0;
    for (const auto& wait : waited.series) {
      if (wait.labels.size() == match.size() + 1 && std::equal(match.begin(), match.end(), wait.labels.begin()) &&
          wait.labels.back().second == "admitted") {
        admitted = static_cast<double>(wait.histogram.count());
      }
    }
    const double ended = static_cast<double>(series.histogram.count());
    holding.series.push_back(plain(std::move(match), std::max(0.0, admitted - ended)));
  }
  return holding;
}

}  // namespace

Metrics Telemetry::snapshot(std::size_t removals_pending) const {
  const Metrics::Labels backend{{"backend", backend_}};
  const auto load = [](const Counter& counter) { return static_cast<double>(counter.load(std::memory_order_relaxed)); };
  // The holds' ends are read before the acquires' admissions: a hold admitted and released in
  // between then shows in neither, and the holds gauge never goes below zero.
  auto held = hold_family("turnstile_hold_seconds", "How long holds were held, from admission to release.", false);
  auto waited = hold_family("turnstile_acquire_wait_seconds",
                            "How long acquires waited, by primitive and outcome (admitted, timed_out, stopped, "
                            "failed).",
                            true);
  auto holding = holds_gauge(held, waited);
  std::vector<Metrics::Family> families;
  families.push_back(std::move(waited));
  families.push_back(std::move(held));
  families.push_back(std::move(holding));
  families.push_back(cause_family("turnstile_holds_suspended_total", "Holds suspended, by cause.", false));
  families.push_back(cause_family("turnstile_holds_lost_total", "Holds (possibly) lost, by cause.", true));
  families.push_back({"turnstile_renewal_seconds",
                      "Round trips of the client's session or lease renewals (none on file://).",
                      Metrics::Type::histogram,
                      {histogram(backend, reports_.round_trip_.read())}});
  families.push_back({"turnstile_renewal_failures_total",
                      "Renewals that failed or got no answer in time.",
                      Metrics::Type::counter,
                      {plain(backend, load(reports_.renewal_failures_))}});
  families.push_back({"turnstile_connections_total",
                      "Connections made to a server (none on file://).",
                      Metrics::Type::counter,
                      {plain(backend, load(reports_.connections_))}});
  families.push_back({"turnstile_reconnects_total",
                      "Connections made to replace a lost one.",
                      Metrics::Type::counter,
                      {plain(backend, load(reports_.reconnects_))}});
  families.push_back({"turnstile_events_dropped_total",
                      "Events not told to the event hook: more than 10,000 waited for it, or the client ended.",
                      Metrics::Type::counter,
                      {plain(backend, events_ ? static_cast<double>(events_->dropped()) : 0.0)}});
  families.push_back({"turnstile_background_removals_pending",
                      "Releases that failed and are retried in the background.",
                      Metrics::Type::gauge,
                      {plain(backend, static_cast<double>(removals_pending))}});
  families.push_back({"turnstile_background_removal_retries_total",
                      "Background tries of failed releases.",
                      Metrics::Type::counter,
                      {plain(backend, load(removal_retries_))}});
  return Metrics(std::move(families));
}

}  // namespace turnstile::detail
