// SPDX-License-Identifier: Apache-2.0
#include "core/text_escape.hpp"

namespace turnstile::detail {
namespace {

constexpr char kUpperDigits[] = "0123456789ABCDEF";
constexpr char kLowerDigits[] = "0123456789abcdef";

const char* digits(HexCase letters) { return letters == HexCase::upper ? kUpperDigits : kLowerDigits; }

// The byte of the escape at text[i] ('%' then two hex digits), or -1 when there is none.
int escape_at(std::string_view text, std::size_t i) {
  if (text[i] != '%' || i + 2 >= text.size()) return -1;
  const int high = hex_digit_value(text[i + 1]);
  const int low = hex_digit_value(text[i + 2]);
  return high < 0 || low < 0 ? -1 : high * 16 + low;
}

}  // namespace

int hex_digit_value(char c) noexcept {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

void append_hex_byte(std::string& out, unsigned char byte, HexCase letters) {
  out += digits(letters)[byte >> 4];
  out += digits(letters)[byte & 15];
}

void append_escaped_byte(std::string& out, unsigned char byte, char marker) {
  out += marker;
  append_hex_byte(out, byte);
}

std::string hex_number(std::uint64_t value, std::size_t width, HexCase letters) {
  std::string reversed;
  do {
    reversed += digits(letters)[value & 15];
    value >>= 4;
  } while (value != 0);
  if (reversed.size() < width) reversed.append(width - reversed.size(), '0');
  return {reversed.rbegin(), reversed.rend()};
}

std::string percent_encode(std::string_view text, KeepsByte keeps, char marker) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (keeps(byte)) {
      out += c;
    } else {
      append_escaped_byte(out, byte, marker);
    }
  }
  return out;
}

std::optional<std::string> percent_decode(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '%') {
      out += text[i];
      continue;
    }
    const int byte = escape_at(text, i);
    if (byte < 0) return std::nullopt;
    out += static_cast<char>(byte);
    i += 2;
  }
  return out;
}

std::string percent_decode_lenient(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    const int byte = escape_at(text, i);
    if (byte < 0) {
      out += text[i];
    } else {
      out += static_cast<char>(byte);
      i += 2;
    }
  }
  return out;
}

}  // namespace turnstile::detail
