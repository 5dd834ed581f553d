// SPDX-License-Identifier: Apache-2.0
#include "run_options.hpp"

#include <turnstile/turnstile.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>

namespace turnstile::cli {

namespace {

// The TTL of the holds when turnstile knows it: --ttl, else the URL's ?ttl= (ZooKeeper:
// ?session_timeout=). Otherwise the backend's default applies, which turnstile cannot see.
std::optional<std::chrono::milliseconds> known_ttl(const RunOptions& options, std::string_view url) {
  const auto milliseconds = [](double seconds) {
    return std::chrono::ceil<std::chrono::milliseconds>(std::chrono::duration<double>(seconds));
  };
  if (options.ttl_sec && *options.ttl_sec > 0) return milliseconds(*options.ttl_sec);  // 0: the URL's or default
  if (url.starts_with("file:")) return std::nullopt;
  const auto q = url.find('?');
  if (q == std::string_view::npos) return std::nullopt;
  for (auto query = url.substr(q + 1); !query.empty();) {
    const auto amp = query.find_first_of("&#");
    const auto pair = query.substr(0, amp);
    query = amp == std::string_view::npos || query[amp] == '#' ? std::string_view{} : query.substr(amp + 1);
    const auto eq = pair.find('=');
    if (eq == std::string_view::npos || (pair.substr(0, eq) != "ttl" && pair.substr(0, eq) != "session_timeout"))
      continue;
    const std::string value(pair.substr(eq + 1));
    char* end = nullptr;
    const double seconds = std::strtod(value.c_str(), &end);
    // The library accepted the URL; anything else here is a form this parse does not know.
    if (end == value.c_str() + value.size() && std::isfinite(seconds) && seconds > 0 && seconds <= 1e9) {
      return milliseconds(seconds);
    }
  }
  return std::nullopt;
}

}  // namespace

std::optional<std::chrono::milliseconds> parse_duration(std::string_view text) {
  static constexpr std::pair<std::string_view, double> kUnits[] = {{"ms", 0.001}, {"s", 1},     {"m", 60},
                                                                   {"h", 3600},   {"d", 86400}, {"", 1}};
  const std::string number_text(text);
  char* end = nullptr;
  const double number = std::strtod(number_text.c_str(), &end);
  if (end == number_text.c_str()) return std::nullopt;
  const std::string_view unit = std::string_view(number_text).substr(end - number_text.c_str());
  for (const auto& [name, seconds] : kUnits) {
    if (unit != name) continue;
    const double total = number * seconds;
    if (!(std::isfinite(total) && total >= 0 && total <= 1e9)) return std::nullopt;
    return std::chrono::ceil<std::chrono::milliseconds>(std::chrono::duration<double>(total));
  }
  return std::nullopt;
}

LossBounds loss_bounds(const RunOptions& options, std::string_view url) {
  using namespace std::chrono_literals;
  const auto ttl = known_ttl(options, url);
  const std::chrono::milliseconds margin = ttl ? std::max<std::chrono::milliseconds>(*ttl / 10, 50ms) : 1000ms;
  return {margin / 2};
}

std::string adopt_flock_forms(const FlockForms& forms, RunOptions& o) {
  if (forms.shared && forms.exclusive) return "give -s/--shared or -x/--exclusive, not both";
  if (forms.nonblock + forms.wait_sec.has_value() + o.timeout_sec.has_value() > 1) {
    return "give one of -n/--nonblock, -w/--wait and --timeout";
  }
  if (forms.wait_sec && !(std::isfinite(*forms.wait_sec) && *forms.wait_sec >= 0 && *forms.wait_sec <= 1e9)) {
    return "-w/--wait must be a number of seconds, 0 to 1e9";
  }
  const bool named = o.lock || o.read || o.write || o.semaphore;
  if (forms.name && named) return "give NAME or one of --lock, --read, --write, --semaphore, not both";
  if (!forms.name && forms.shared && !o.read) return "-s/--shared goes with a bare NAME (or --read NAME)";
  if (!forms.name && forms.exclusive && !o.write && !o.lock) {
    return "-x/--exclusive goes with a bare NAME (or --write NAME, --lock NAME)";
  }
  if (forms.nonblock) o.timeout_sec = 0;
  if (forms.wait_sec) o.timeout_sec = forms.wait_sec;
  if (forms.name) (forms.shared ? o.read : forms.exclusive ? o.write : o.lock) = *forms.name;
  return {};
}

std::string usage_problem(const RunOptions& o, bool needs_command) {
  const int chosen = !!o.lock + !!o.read + !!o.write + !!o.semaphore + !!o.elect;
  if (chosen != 1) return "give a NAME, or exactly one of --lock, --read, --write, --semaphore";
  if (o.semaphore && !o.limit) return "--semaphore needs --limit N";
  if (!o.semaphore && o.limit) return "--limit goes only with --semaphore";
  if (o.limit && (*o.limit < 1 || *o.limit > max_permits)) {
    return "--limit must be a whole number from 1 to " + std::to_string(max_permits) + ", got " +
           std::to_string(*o.limit);
  }
  // Up to ~30 years: larger values would overflow the clocks' arithmetic.
  const auto bad_seconds = [](const std::optional<double>& value) {
    return value && !(std::isfinite(*value) && *value >= 0 && *value <= 1e9);
  };
  if (bad_seconds(o.timeout_sec)) return "--timeout must be a number of seconds, 0 to 1e9";
  if (bad_seconds(o.ttl_sec)) return "--ttl must be a number of seconds, 0 to 1e9";
  if (bad_seconds(std::optional<double>(o.grace_sec))) return "--grace must be a number of seconds, 0 to 1e9";
  if (!(std::isfinite(o.connect_timeout_sec) && o.connect_timeout_sec > 0 && o.connect_timeout_sec <= 1e9)) {
    return "--connect-timeout must be a number of seconds, more than 0 and at most 1e9";
  }
  if (o.conflict_exit_code && (*o.conflict_exit_code < 0 || *o.conflict_exit_code > 255)) {
    return "--conflict-exit-code must be 0 to 255, got " + std::to_string(*o.conflict_exit_code);
  }
  if (o.leader_value && o.leader_value->size() > max_election_value) {
    return "--value is at most " + std::to_string(max_election_value) + " bytes";
  }
  if (o.hold_at_least && !parse_duration(*o.hold_at_least)) {
    return "--hold-at-least must be a duration such as 30s, 5m or 1h (a plain number is seconds), 0 to 1e9 s; got '" +
           *o.hold_at_least + "'";
  }
  if (!needs_command) return {};
  if (o.shell && !o.command.empty()) return "give either -c 'COMMAND LINE' or a COMMAND after '--', not both";
  if (o.shell && o.shell->empty()) return "-c needs a command line";
  if (!o.shell && o.command.empty()) return "no command to run: put it after '--' (or give -c 'COMMAND LINE')";
  return {};
}

}  // namespace turnstile::cli
