// SPDX-License-Identifier: Apache-2.0
// `turnstile inspect` without NAME (or with --prefix): one line per name in use, with its
// holder and waiter counts (Client::names_in_use).
#include "inspect_list.hpp"

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common.hpp"
#include "text_table.hpp"

namespace turnstile::cli {

std::string render_names_table(const std::string& backend, const std::string& prefix, const NamesInUse& names) {
  std::string out = "backend  " + printable(backend) + "\n";
  if (!prefix.empty()) out += "prefix   " + printable(prefix) + "\n";
  if (names.names.empty()) {
    out += names.truncated ? "(no name in use among those looked at; the backend has more)\n" : "(no name in use)\n";
    return out;
  }
  // NAME as wide as the widest name shown, on a terminal (names are at most 255 bytes, but
  // printable() may spell one in four times as many characters).
  std::vector<std::vector<std::string>> rows{{"NAME", "MODE", "LIMIT", "HOLDERS", "WAITERS"}};
  for (const auto& n : names.names) {
    rows.push_back({printable(n.name), printable(n.mode), n.mode == "semaphore" ? std::to_string(n.limit) : "-",
                    std::to_string(n.holders), std::to_string(n.waiters)});
  }
  out += aligned_rows(rows, {{4}, {9}, {13, true}, {8, true}, {8, true}}, 2);
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
