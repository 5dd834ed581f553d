// SPDX-License-Identifier: Apache-2.0
// `turnstile inspect` without NAME (or with --prefix): one line per name in use, with its
// holder and waiter counts (Client::names_in_use).
#include "inspect_list.hpp"

#include <algorithm>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "common.hpp"

namespace turnstile::cli {

std::string render_names_table(const std::string& backend, const std::string& prefix, const NamesInUse& names) {
  std::string out = "backend  " + printable(backend) + "\n";
  if (!prefix.empty()) out += "prefix   " + printable(prefix) + "\n";
  if (names.names.empty()) {
    out += names.truncated ? "(no name in use among those looked at; the backend has more)\n" : "(no name in use)\n";
    return out;
  }
  // The name column is as wide as the widest name shown (names are at most 255 bytes).
  std::size_t width = 4;
  for (const auto& n : names.names) width = std::max(width, printable(n.name).size());
  char line[512];
  std::snprintf(line, sizeof line, "%-*s  %-9s  %13s  %8s  %8s\n", static_cast<int>(width), "NAME", "MODE", "LIMIT",
                "HOLDERS", "WAITERS");
  out += line;
  for (const auto& n : names.names) {
    const auto limit = n.mode == "semaphore" ? std::to_string(n.limit) : std::string("-");
    std::snprintf(line, sizeof line, "%-*s  %-9s  %13s  %8zu  %8zu\n", static_cast<int>(width),
                  printable(n.name).c_str(), printable(n.mode).c_str(), limit.c_str(), n.holders, n.waiters);
    out += line;
  }
  if (names.truncated) {
    out += "(the first " + std::to_string(names.names.size()) +
           " in name order; more may be in use: narrow with --prefix or raise --max-names)\n";
  }
  return out;
}

std::string render_names_json(const std::string& backend, const std::string& prefix, const NamesInUse& names,
                              int schema_version, std::optional<std::chrono::system_clock::time_point> time) {
  auto list = nlohmann::ordered_json::array();
  for (const auto& n : names.names) {
    list.push_back(
        {{"name", n.name},
         {"mode", n.mode},
         {"limit", n.mode == "semaphore" ? nlohmann::ordered_json(n.limit) : nlohmann::ordered_json(nullptr)},
         {"holders", n.holders},
         {"waiters", n.waiters}});
  }
  nlohmann::ordered_json out = {
      {"schema_version", schema_version},
      {"backend", backend},
      {"time", time ? nlohmann::ordered_json(iso8601(*time)) : nlohmann::ordered_json(nullptr)},
      {"prefix", prefix},
      {"names", list},
      {"truncated", names.truncated}};
  // Names a peer wrote may hold bytes that are not UTF-8: U+FFFD instead of an exception.
  return out.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

}  // namespace turnstile::cli
