// SPDX-License-Identifier: Apache-2.0
// The names in use under a prefix (Client::names_in_use), over any backend: its scan proposes
// names, its inspect_each counts their holders and waiters.
#pragma once

#include <cstddef>
#include <string_view>

#include "core/backend.hpp"

namespace turnstile::detail {

// Throws InvalidArgument for a prefix no name could start with or max_names out of 1..10,000.
NamesInUse names_in_use(Backend& backend, std::string_view prefix, std::size_t max_names, Deadline deadline);

}  // namespace turnstile::detail
