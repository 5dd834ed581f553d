// SPDX-License-Identifier: Apache-2.0
// Hex digits and %XX escapes, written once for every place that keeps arbitrary bytes in a
// narrower alphabet: state file names, ZooKeeper paths, Redis hash tags, Consul keys and
// values, URLs, the hold-history format and the CLI's terminal output. Each caller keeps its
// own rule of which bytes stay as they are (that rule is its layout); the spelling is shared.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace turnstile::detail {

enum class HexCase { upper, lower };

// 0-15 for a hex digit of either case, -1 for any other character.
int hex_digit_value(char c) noexcept;

// Appends the byte's two hex digits ("0A" / "0a").
void append_hex_byte(std::string& out, unsigned char byte, HexCase letters = HexCase::upper);

// Appends `marker` and the byte's two upper-case hex digits: "%2F", or ",2F" for Consul keys.
void append_escaped_byte(std::string& out, unsigned char byte, char marker = '%');

// `value` in hex without leading zeros (0 is "0"), padded with zeros to `width` digits.
std::string hex_number(std::uint64_t value, std::size_t width = 0, HexCase letters = HexCase::lower);

// Which bytes a layout keeps as they are; every other byte is escaped.
using KeepsByte = bool (*)(unsigned char byte);

// `text` with each byte `keeps` refuses written as `marker` + two upper-case hex digits. The
// marker itself must be one of the refused bytes, or the encoding is not one-to-one.
std::string percent_encode(std::string_view text, KeepsByte keeps, char marker = '%');

// `text` with every %XX decoded (either case); nullopt when a '%' is not followed by two hex
// digits, so the caller can refuse the input in its own words.
std::optional<std::string> percent_decode(std::string_view text);

// As percent_decode, but a '%' that does not start an escape stays as it is: for text a peer
// wrote, which is shown rather than refused.
std::string percent_decode_lenient(std::string_view text);

}  // namespace turnstile::detail
