// SPDX-License-Identifier: Apache-2.0
// A PermitCounter's count as its node's text holds it: any integer a peer may have written.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace turnstile::detail::zookeeper {

// A count as a peer may have written it: any integer. Exact in 128 bits up to 38 digits; of a
// longer one only the sign is kept (`exact` false): drain resets it, nothing else changes it.
struct Count {
  __int128 value = 0;
  bool exact = true;
};

// The count `text` holds; nullopt when it is no integer.
std::optional<Count> parse_count(const std::string& text);
// The text of a count, as it is written.
std::string count_text(__int128 value);
// What the API returns of a count: counts beyond 64 bits (a peer's) as the nearest 64-bit one
// ("at least INT64_MAX permits"); every count written is exact.
std::int64_t saturated(__int128 value);
// The count a node holds; a node that does not hold one (a peer's, or data too large to read)
// is refused rather than overwritten.
Count count_of(const std::string& text, const std::string& name);
// Refuses to change a count of more than 38 digits (a peer's): its new value cannot be written
// exactly. drain_permits() resets it.
void require_exact(const Count& count, const std::string& name);

}  // namespace turnstile::detail::zookeeper
