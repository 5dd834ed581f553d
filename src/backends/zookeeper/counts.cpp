// SPDX-License-Identifier: Apache-2.0
#include "backends/zookeeper/counts.hpp"

#include <algorithm>
#include <limits>
#include <string_view>

#include "turnstile/error.hpp"

namespace turnstile::detail::zookeeper {

std::optional<Count> parse_count(const std::string& text) {
  std::string_view digits(text);
  const bool negative = digits.starts_with('-');
  if (negative) digits.remove_prefix(1);
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  while (digits.size() > 1 && digits.front() == '0') digits.remove_prefix(1);
  Count count;
  if (digits.size() > 38) {
    count.exact = false;
    count.value = 1;
    for (int i = 0; i < 38; ++i) count.value *= 10;
  } else {
    for (const char c : digits) count.value = count.value * 10 + (c - '0');
  }
  if (negative) count.value = -count.value;
  return count;
}

std::string count_text(__int128 value) {
  const bool negative = value < 0;
  unsigned __int128 magnitude =
      negative ? -static_cast<unsigned __int128>(value) : static_cast<unsigned __int128>(value);
  std::string text;
  do {
    text.insert(text.begin(), static_cast<char>('0' + static_cast<int>(magnitude % 10)));
    magnitude /= 10;
  } while (magnitude != 0);
  return negative ? "-" + text : text;
}

std::int64_t saturated(__int128 value) {
  constexpr auto high = std::numeric_limits<std::int64_t>::max();
  constexpr auto low = std::numeric_limits<std::int64_t>::min();
  return value > high ? high : value < low ? low : static_cast<std::int64_t>(value);
}

Count count_of(const std::string& text, const std::string& name) {
  const auto count = parse_count(text);
  if (!count) throw BackendUnavailable("the PermitCounter node of '" + name + "' does not hold a number");
  return *count;
}

void require_exact(const Count& count, const std::string& name) {
  if (!count.exact) {
    throw InvalidArgument("PermitCounter '" + name +
                          "' holds a count of more than 38 digits, which cannot be changed " +
                          "exactly; drain_permits() resets it. Nothing changed");
  }
}

}  // namespace turnstile::detail::zookeeper
