#include "run_options.hpp"

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

LossBounds loss_bounds(const RunOptions& options, std::string_view url) {
  using namespace std::chrono_literals;
  const auto ttl = known_ttl(options, url);
  const std::chrono::milliseconds margin = ttl ? std::max<std::chrono::milliseconds>(*ttl / 10, 50ms) : 1000ms;
  return {margin / 2};
}

std::string usage_problem(const RunOptions& o, bool needs_command) {
  const int chosen = !!o.lock + !!o.read + !!o.write + !!o.semaphore;
  if (chosen != 1) return "give exactly one of --lock, --read, --write, --semaphore";
  if (o.semaphore && !o.limit) return "--semaphore needs --limit N";
  if (!o.semaphore && o.limit) return "--limit goes only with --semaphore";
  if (o.limit && *o.limit < 1) return "--limit must be at least 1, got " + std::to_string(*o.limit);
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
  if (!needs_command) return {};
  if (o.shell && !o.command.empty()) return "give either -c 'COMMAND LINE' or a COMMAND after '--', not both";
  if (o.shell && o.shell->empty()) return "-c needs a command line";
  if (!o.shell && o.command.empty()) return "no command to run: put it after '--' (or give -c 'COMMAND LINE')";
  return {};
}

}  // namespace turnstile::cli
