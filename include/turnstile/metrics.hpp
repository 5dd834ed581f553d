// SPDX-License-Identifier: Apache-2.0
// What a Client counts (Client::metrics(), rendered in Prometheus' text format) and what it
// tells as it happens (ClientOptions::on_event, json_lines_sink). See docs/metrics.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace turnstile {

// One thing that happened to an acquire, a hold or the client's connection to its backend.
enum class EventKind : std::uint8_t {
  acquired,        // an acquire was admitted: duration = how long it waited
  not_acquired,    // an acquire ended without a hold: outcome timed_out, stopped or failed
  released,        // a hold ended by its release: duration = how long it was held
  suspended,       // outcome = the cause (see docs/metrics.md), reason = the backend's words
  resumed,         // a suspended hold is held again
  lost,            // outcome = the cause, reason = the backend's words
  renewed,         // a renewal of the client's session or lease: duration = its round trip
  renewal_failed,  // a renewal got no answer or an error: reason says which
  connected,       // the client reached its server for the first time
  reconnected,     // the client reached its server again after losing its connection
};
const char* to_string(EventKind kind) noexcept;

struct Event {
  EventKind kind = EventKind::acquired;
  std::chrono::system_clock::time_point time;
  std::string backend;              // "file", "redis", "zookeeper", "etcd" or "consul"
  std::string primitive;            // "mutex", "recursive_mutex", "shared_mutex", "semaphore", "election",
                                    // "permit_counter"; "" for the client's own (renewals, connections)
  std::string name;                 // the hold's or acquire's name; "" for the client's own
  std::uint64_t fencing_token = 0;  // the hold's; 0 where there is none
  // acquires: "admitted", "timed_out", "stopped" or "failed"; suspensions and losses: the cause.
  std::string outcome;
  std::string reason;                    // free text: an error, why a hold was suspended or lost
  std::chrono::nanoseconds duration{0};  // as the kind says; zero where none applies
};
using EventHandler = std::function<void(const Event&)>;

// One JSON object on one line (ending in '\n'): {"time":"2026-11-27T18:02:33.123456Z",
// "event":"acquired","backend":...,"duration_seconds":...}; empty fields are left out.
std::string to_json_line(const Event& event);
// An EventHandler writing to_json_line() of each event to `fd` (not closed by it), lines of
// concurrent events never interleaved. A line the descriptor has not taken within a second (a
// pipe nobody reads) is given up, and one given up part-way is ended before the next; write
// errors are ignored: telling must never fail a hold.
EventHandler json_lines_sink(int fd);

// A snapshot of a Client's counters and histograms (Client::metrics()): plain values, copied
// out of the client's atomics; rendered by prometheus_text().
class Metrics {
 public:
  using Labels = std::vector<std::pair<std::string, std::string>>;
  enum class Type : std::uint8_t { counter, gauge, histogram };
  struct Histogram {
    std::vector<double> upper_bounds;   // seconds, ascending; the +Inf bucket is implied
    std::vector<std::uint64_t> counts;  // per bucket, not cumulative: upper_bounds.size() + 1
    double sum = 0;                     // seconds
    std::uint64_t count() const;
  };
  struct Series {
    Labels labels;
    double value = 0;     // counters and gauges
    Histogram histogram;  // histograms
  };
  struct Family {
    std::string name;  // the full metric name: turnstile_..._total for counters
    std::string help;
    Type type = Type::counter;
    std::vector<Series> series;
  };

  Metrics() = default;
  explicit Metrics(std::vector<Family> families) : families_(std::move(families)) {}

  const std::vector<Family>& families() const { return families_; }
  const Family* family(std::string_view name) const;
  // The sum of the values (counters, gauges) or observation counts (histograms) of the series
  // of `name` that carry every label of `match`; 0 when there are none.
  double value(std::string_view name, const Labels& match = {}) const;
  std::uint64_t histogram_count(std::string_view name, const Labels& match = {}) const;
  // The Prometheus text exposition format 0.0.4: # HELP and # TYPE lines, then the samples;
  // label values escaped (\\, \", \n), histograms as _bucket{le="..."}, _sum and _count.
  std::string prometheus_text() const;

 private:
  std::vector<Family> families_;
};

}  // namespace turnstile
