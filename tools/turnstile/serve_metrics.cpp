// SPDX-License-Identifier: Apache-2.0
// `turnstile serve`'s /metrics: gauges of what the backend shows, in Prometheus' text format
// (version 0.0.4). Every family is named turnstile_backend_* or turnstile_serve_*, apart from
// the library's own (Client::metrics()), which the server appends.
#include <algorithm>
#include <cstdio>

#include "common.hpp"
#include "serve.hpp"

namespace turnstile::cli {
namespace {

struct Family {
  const char* name;
  const char* type;  // "gauge" or "counter"
  const char* help;
};

void header(std::string& out, const Family& family) {
  out +=
      std::string("# HELP ") + family.name + " " + family.help + "\n# TYPE " + family.name + " " + family.type + "\n";
}

std::string number(double value) {
  char text[40];
  std::snprintf(text, sizeof text, "%.17g", value);
  return text;
}

void sample(std::string& out, const Family& family, double value, const std::string& labels = "") {
  out += std::string(family.name) + labels + " " + number(value) + "\n";
}

// A label value as the text format spells it: \\ and " escaped, so that it reads back as the
// name itself. Names are UTF-8 without control characters; a key a peer wrote otherwise (which
// would break the whole scrape) is spelled as inspect spells it instead.
std::string label_value(std::string_view text) {
  std::string backslashes_doubled;
  for (const char c : text) backslashes_doubled += c == '\\' ? std::string("\\\\") : std::string(1, c);
  const auto spelled = printable(text);
  std::string out;
  for (const char c : spelled == backslashes_doubled ? std::string(text) : spelled) {
    if (c == '\\' || c == '"') out += '\\';
    out += c;
  }
  return out;
}

// The longest age among `entries` (0 when none has a known start).
double longest(const std::vector<EntryInfo>& entries, std::chrono::system_clock::time_point now) {
  double most = 0;
  for (const auto& e : entries) {
    if (e.foreign.empty()) most = std::max(most, seconds_since(e.since, now));
  }
  return most;
}

constexpr Family kUp{"turnstile_backend_up", "gauge", "1 when the last look at the backend succeeded, else 0."};
constexpr Family kNames{"turnstile_backend_names_in_use", "gauge", "Names whose queues have holders or waiters."};
constexpr Family kTruncated{"turnstile_backend_names_truncated", "gauge",
                            "1 when more names were in use than looked at (--max-names)."};
constexpr Family kHolders{"turnstile_backend_holders", "gauge", "Holders of the names in use."};
constexpr Family kWaiters{"turnstile_backend_waiters", "gauge", "Waiters in the queues of the names in use."};
constexpr Family kLongestHold{"turnstile_backend_longest_hold_seconds", "gauge",
                              "The longest current hold, in seconds (0 when nothing is held)."};
constexpr Family kLongestWait{"turnstile_backend_longest_wait_seconds", "gauge",
                              "The longest current wait, in seconds (0 when nobody waits)."};
constexpr Family kNameHolders{"turnstile_backend_name_holders", "gauge", "Holders of each name (--name-label)."};
constexpr Family kNameWaiters{"turnstile_backend_name_waiters", "gauge", "Waiters of each name (--name-label)."};
constexpr Family kNameHold{"turnstile_backend_name_longest_hold_seconds", "gauge",
                           "The longest current hold of each name, in seconds (--name-label)."};
constexpr Family kNameWait{"turnstile_backend_name_longest_wait_seconds", "gauge",
                           "The longest current wait of each name, in seconds (--name-label)."};
constexpr Family kPolls{"turnstile_serve_polls_total", "counter", "Looks at the backend."};
constexpr Family kFailedPolls{"turnstile_serve_failed_polls_total", "counter", "Looks at the backend that failed."};
constexpr Family kLastPoll{"turnstile_serve_last_poll_timestamp_seconds", "gauge",
                           "When the last look at the backend ended (Unix time)."};
constexpr Family kLivePages{"turnstile_serve_live_pages", "gauge", "Pages following the live stream now."};

void per_name_series(std::string& out, const ServedState& state, std::chrono::system_clock::time_point now) {
  const auto count = std::min(state.queues.size(), kMaxNameSeries);
  const auto series = [&](const Family& family, auto value_of) {
    header(out, family);
    for (std::size_t i = 0; i < count; ++i) {
      const auto& q = state.queues[i];
      sample(out, family, value_of(q), "{name=\"" + label_value(q.name) + "\"}");
    }
  };
  series(kNameHolders, [](const Inspection& q) { return static_cast<double>(q.holders.size()); });
  series(kNameWaiters, [](const Inspection& q) { return static_cast<double>(q.waiters.size()); });
  series(kNameHold, [&](const Inspection& q) { return longest(q.holders, now); });
  series(kNameWait, [&](const Inspection& q) { return longest(q.waiters, now); });
}

}  // namespace

std::string render_backend_metrics(const ServedState& state, bool per_name, std::size_t live_pages,
                                   std::chrono::system_clock::time_point now) {
  double holders = 0, waiters = 0, longest_hold = 0, longest_wait = 0;
  for (const auto& q : state.queues) {
    holders += static_cast<double>(q.holders.size());
    waiters += static_cast<double>(q.waiters.size());
    longest_hold = std::max(longest_hold, longest(q.holders, now));
    longest_wait = std::max(longest_wait, longest(q.waiters, now));
  }
  std::string out;
  const auto gauge = [&](const Family& family, double value) {
    header(out, family);
    sample(out, family, value);
  };
  gauge(kUp, state.polls > 0 && state.error.empty() ? 1 : 0);
  gauge(kNames, static_cast<double>(state.queues.size()));
  gauge(kTruncated, state.truncated ? 1 : 0);
  gauge(kHolders, holders);
  gauge(kWaiters, waiters);
  gauge(kLongestHold, longest_hold);
  gauge(kLongestWait, longest_wait);
  if (per_name) per_name_series(out, state, now);
  // Counters: named with _total in HELP, TYPE and the sample alike, as the text format 0.0.4
  // has it (and as the library's part of /metrics does).
  for (const auto& [family, value] : {std::pair{kPolls, state.polls}, std::pair{kFailedPolls, state.failed_polls}}) {
    out += "# HELP " + std::string(family.name) + " " + family.help + "\n# TYPE " + family.name + " counter\n";
    sample(out, family, static_cast<double>(value));
  }
  gauge(kLastPoll, state.polls > 0 ? std::chrono::duration<double>(state.taken.time_since_epoch()).count() : 0);
  gauge(kLivePages, static_cast<double>(live_pages));
  return out;
}

}  // namespace turnstile::cli
