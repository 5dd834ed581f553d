// SPDX-License-Identifier: Apache-2.0
// `turnstile inspect` without NAME: the names in use, as a table or one JSON object.
#pragma once

#include <chrono>
#include <optional>
#include <string>

#include <turnstile/turnstile.hpp>

namespace turnstile::cli {

// The most a listing may take, connecting aside: a huge keyspace or a slow server ends it with
// an error instead of an inspect that never returns.
inline constexpr std::chrono::seconds kListingTime{10};

// `backend`: the URL read and where it came from; `prefix`: "" for every name.
std::string render_names_table(const std::string& backend, const std::string& prefix, const NamesInUse& names);
// `time`: when the look was made (--watch --json lines carry it); none: the field is null.
std::string render_names_json(const std::string& backend, const std::string& prefix, const NamesInUse& names,
                              int schema_version, std::optional<std::chrono::system_clock::time_point> time);

}  // namespace turnstile::cli
