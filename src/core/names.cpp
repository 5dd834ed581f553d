// SPDX-License-Identifier: Apache-2.0
#include <string>

#include "core/backend.hpp"

namespace turnstile::detail {
namespace {

// Length of the UTF-8 sequence starting at s[i], or 0 when it is not well-formed.
std::size_t utf8_sequence_length(std::string_view s, std::size_t i) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char lead = byte(i);
  std::size_t length;
  std::uint32_t code;
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) {
    length = 2;
    code = lead & 0x1F;
  } else if ((lead & 0xF0) == 0xE0) {
    length = 3;
    code = lead & 0x0F;
  } else if ((lead & 0xF8) == 0xF0) {
    length = 4;
    code = lead & 0x07;
  } else return 0;
  if (i + length > s.size()) return 0;
  for (std::size_t k = 1; k < length; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    code = (code << 6) | (byte(i + k) & 0x3F);
  }
  static constexpr std::uint32_t smallest[] = {0, 0, 0x80, 0x800, 0x10000};
  if (code < smallest[length] || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return 0;
  return length;
}

}  // namespace

void validate_name(std::string_view name) {
  constexpr std::size_t max_length = 255;
  const auto reject = [&](const std::string& why) { throw InvalidArgument("invalid name: " + why); };
  if (name.empty()) reject("it is empty");
  if (name.size() > max_length) {
    reject("it is " + std::to_string(name.size()) + " bytes long, the limit is " + std::to_string(max_length));
  }
  if (name.front() == '/' || name.back() == '/') reject("'" + std::string(name) + "' starts or ends with '/'");
  for (std::size_t i = 0; i < name.size();) {
    const auto c = static_cast<unsigned char>(name[i]);
    if (c < 0x20 || c == 0x7F) reject("it contains the control character " + std::to_string(c));
    const auto length = utf8_sequence_length(name, i);
    if (length == 0) reject("it is not valid UTF-8 at byte " + std::to_string(i));
    i += length;
  }
  std::size_t start = 0;
  while (start <= name.size()) {
    const auto end = std::min(name.find('/', start), name.size());
    const auto segment = name.substr(start, end - start);
    if (segment.empty()) reject("'" + std::string(name) + "' has an empty segment");
    if (segment == "." || segment == "..") reject("'" + std::string(name) + "' has a '.' or '..' segment");
    start = end + 1;
  }
}

}  // namespace turnstile::detail
