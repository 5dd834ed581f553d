// SPDX-License-Identifier: Apache-2.0
// Metrics snapshots in Prometheus' text format, and events as JSON lines (turnstile/metrics.hpp).
#include "turnstile/metrics.hpp"

#include <algorithm>
#include <charconv>
#include <ctime>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>

#include "core/bounded_write.hpp"

namespace turnstile {
namespace {

// Shortest text that reads back as the same double, never in exponent form ("0.0005", "3").
std::string number(double value) {
  std::array<char, 400> text{};
  const auto end = std::to_chars(text.data(), text.data() + text.size(), value, std::chars_format::fixed).ptr;
  return std::string(text.data(), end);
}

// The exposition format's escapes: \\ and \n everywhere, \" inside label values too.
std::string escaped(std::string_view text, bool label_value) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else if (c == '"' && label_value) out += "\\\"";
    else out += c;
  }
  return out;
}

// {a="x",b="y"} with `extra` (le="...") last; "" when there are no labels at all.
std::string label_text(const Metrics::Labels& labels, const std::string& extra = {}) {
  std::string out;
  for (const auto& [key, value] : labels) {
    out += out.empty() ? "{" : ",";
    out += key + "=\"" + escaped(value, true) + "\"";
  }
  if (!extra.empty()) out += (out.empty() ? "{" : ",") + extra;
  return out.empty() ? out : out + "}";
}

bool matches(const Metrics::Labels& labels, const Metrics::Labels& match) {
  return std::all_of(match.begin(), match.end(), [&](const auto& wanted) {
    return std::find(labels.begin(), labels.end(), wanted) != labels.end();
  });
}

const char* type_name(Metrics::Type type) {
  switch (type) {
    case Metrics::Type::counter: return "counter";
    case Metrics::Type::gauge: return "gauge";
    case Metrics::Type::histogram: return "histogram";
  }
  return "untyped";
}

void render_histogram(std::string& out, const std::string& name, const Metrics::Series& series) {
  const auto& histogram = series.histogram;
  std::uint64_t cumulative = 0;
  for (std::size_t bucket = 0; bucket < histogram.counts.size(); ++bucket) {
    cumulative += histogram.counts[bucket];
    const auto le = bucket < histogram.upper_bounds.size() ? number(histogram.upper_bounds[bucket]) : "+Inf";
    out += name + "_bucket" + label_text(series.labels, "le=\"" + le + "\"") + " " + std::to_string(cumulative) + "\n";
  }
  out += name + "_sum" + label_text(series.labels) + " " + number(histogram.sum) + "\n";
  out += name + "_count" + label_text(series.labels) + " " + std::to_string(cumulative) + "\n";
}

// RFC 3339 in UTC with microseconds: 2026-11-27T18:02:33.123456Z.
std::string utc_text(std::chrono::system_clock::time_point time) {
  const auto micros = std::chrono::floor<std::chrono::microseconds>(time.time_since_epoch()).count();
  const std::time_t seconds = static_cast<std::time_t>(micros / 1'000'000 - (micros % 1'000'000 < 0 ? 1 : 0));
  std::tm parts{};
  ::gmtime_r(&seconds, &parts);
  std::array<char, 40> text{};
  const auto length = std::strftime(text.data(), text.size(), "%Y-%m-%dT%H:%M:%S", &parts);
  std::array<char, 16> fraction{};
  std::snprintf(fraction.data(), fraction.size(), ".%06lldZ",
                static_cast<long long>((micros % 1'000'000 + 1'000'000) % 1'000'000));
  return std::string(text.data(), length) + fraction.data();
}

}  // namespace

std::uint64_t Metrics::Histogram::count() const {
  return std::accumulate(counts.begin(), counts.end(), std::uint64_t{0});
}

const Metrics::Family* Metrics::family(std::string_view name) const {
  const auto found = std::find_if(families_.begin(), families_.end(), [&](const auto& f) { return f.name == name; });
  return found == families_.end() ? nullptr : &*found;
}

double Metrics::value(std::string_view name, const Labels& match) const {
  const auto* found = family(name);
  if (!found) return 0;
  double sum = 0;
  for (const auto& series : found->series) {
    if (!matches(series.labels, match)) continue;
    sum += found->type == Type::histogram ? static_cast<double>(series.histogram.count()) : series.value;
  }
  return sum;
}

std::uint64_t Metrics::histogram_count(std::string_view name, const Labels& match) const {
  const auto* found = family(name);
  if (!found || found->type != Type::histogram) return 0;
  std::uint64_t sum = 0;
  for (const auto& series : found->series) {
    if (matches(series.labels, match)) sum += series.histogram.count();
  }
  return sum;
}

std::string Metrics::prometheus_text() const {
  std::string out;
  for (const auto& family : families_) {
    out += "# HELP " + family.name + " " + escaped(family.help, false) + "\n";
    out += "# TYPE " + family.name + " " + type_name(family.type) + "\n";
    for (const auto& series : family.series) {
      if (family.type == Type::histogram) {
        render_histogram(out, family.name, series);
      } else {
        out += family.name + label_text(series.labels) + " " + number(series.value) + "\n";
      }
    }
  }
  return out;
}

const char* to_string(EventKind kind) noexcept {
  switch (kind) {
    case EventKind::acquired: return "acquired";
    case EventKind::not_acquired: return "not_acquired";
    case EventKind::released: return "released";
    case EventKind::suspended: return "suspended";
    case EventKind::resumed: return "resumed";
    case EventKind::lost: return "lost";
    case EventKind::renewed: return "renewed";
    case EventKind::renewal_failed: return "renewal_failed";
    case EventKind::connected: return "connected";
    case EventKind::reconnected: return "reconnected";
  }
  return "unknown";
}

std::string to_json_line(const Event& event) {
  nlohmann::ordered_json line;
  line["time"] = utc_text(event.time);
  line["event"] = to_string(event.kind);
  const auto text = [&](const char* key, const std::string& value) {
    if (!value.empty()) line[key] = value;
  };
  text("backend", event.backend);
  text("primitive", event.primitive);
  text("name", event.name);
  if (event.fencing_token != 0) line["fencing_token"] = event.fencing_token;
  text("outcome", event.outcome);
  text("reason", event.reason);
  if (event.duration.count() != 0) line["duration_seconds"] = static_cast<double>(event.duration.count()) / 1e9;
  // Bytes that are not UTF-8 (a backend's message) become U+FFFD rather than failing the line.
  return line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

EventHandler json_lines_sink(int fd) {
  struct Writer {
    std::mutex order;
    bool torn = false;  // the last line was cut short: the next one starts on a line of its own
  };
  auto writer = std::make_shared<Writer>();
  return [fd, writer](const Event& event) {
    const auto line = to_json_line(event);
    std::lock_guard lock(writer->order);
    const std::string text = writer->torn ? "\n" + line : line;
    // A line the descriptor has not taken within a second (a pipe nobody reads) is given up: the
    // client's later events and its end must not wait on it for good.
    const auto written = detail::write_within(fd, text, std::chrono::seconds(1));
    if (written > 0) writer->torn = written < text.size();
  };
}

}  // namespace turnstile
