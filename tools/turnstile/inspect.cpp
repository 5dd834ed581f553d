// `turnstile inspect`: the holders and waiters of a name, as a table or one JSON object.
#include <ctime>
#include <cstdio>
#include <iostream>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "common.hpp"

namespace turnstile::cli {
namespace {

// ISO 8601 in UTC with milliseconds: 2024-05-01T10:00:00.123Z.
std::string iso8601(std::chrono::system_clock::time_point when) {
  const auto ms = std::chrono::floor<std::chrono::milliseconds>(when.time_since_epoch());
  const auto seconds = std::chrono::floor<std::chrono::seconds>(ms);
  const std::time_t t = seconds.count();
  std::tm utc{};
  gmtime_r(&t, &utc);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", utc.tm_year + 1900, utc.tm_mon + 1,
                utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec, static_cast<int>((ms - seconds).count()));
  return buf;
}

nlohmann::ordered_json entries_json(const std::vector<EntryInfo>& entries) {
  auto out = nlohmann::ordered_json::array();
  for (const auto& e : entries) {
    out.push_back({{"fencing_token", e.fencing_token},
                   {"kind", e.kind},
                   {"permits", e.permits},
                   {"pid", e.pid},
                   {"host", e.host},
                   {"since", iso8601(e.since)}});
  }
  return out;
}

void print_json(const Inspection& q) {
  nlohmann::ordered_json out = {{"name", q.name},
                        {"mode", q.mode},
                        {"limit", q.mode == "semaphore" ? nlohmann::ordered_json(q.limit) : nlohmann::ordered_json(nullptr)},
                        {"permits", q.permits ? nlohmann::ordered_json(*q.permits) : nlohmann::ordered_json(nullptr)},
                        {"holders", entries_json(q.holders)},
                        {"waiters", entries_json(q.waiters)}};
  std::cout << out.dump() << '\n';
}

void print_table(const Inspection& q) {
  std::printf("name     %s\n", q.name.c_str());
  if (q.mode.empty()) {
    std::printf("mode     (nobody queued)\n");
  } else if (q.mode == "semaphore") {
    std::printf("mode     semaphore, limit %lld\n", static_cast<long long>(q.limit));
  } else {
    std::printf("mode     %s\n", q.mode.c_str());
  }
  if (q.permits) std::printf("permits  %lld\n", static_cast<long long>(*q.permits));
  if (q.holders.empty() && q.waiters.empty()) return;
  std::printf("%-8s %-10s %-10s %-8s %-25s %-8s %s\n", "ROLE", "TOKEN", "KIND", "PERMITS", "SINCE", "PID", "HOST");
  const auto rows = [](const char* role, const std::vector<EntryInfo>& entries) {
    for (const auto& e : entries) {
      std::printf("%-8s %-10llu %-10s %-8lld %-25s %-8lld %s\n", role, static_cast<unsigned long long>(e.fencing_token),
                  e.kind.c_str(), static_cast<long long>(e.permits), iso8601(e.since).c_str(),
                  static_cast<long long>(e.pid), e.host.c_str());
    }
  };
  rows("holder", q.holders);
  rows("waiter", q.waiters);
}

}  // namespace

int inspect_command(const InspectOptions& options) {
  try {
    auto client = connect_backend(options.backend);
    const auto inspection = client.inspect(options.name);
    if (options.json) {
      print_json(inspection);
    } else {
      print_table(inspection);
    }
    return 0;
  } catch (const Error& error) {
    complain(error.what());
    return exit_status_for(error);
  }
}

}  // namespace turnstile::cli
