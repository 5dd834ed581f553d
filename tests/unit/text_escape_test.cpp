// SPDX-License-Identifier: Apache-2.0
// The shared hex and %XX spelling (core/text_escape.hpp) and the host name (core/host_name.hpp):
// every byte round-trips, malformed escapes are refused (or kept, by the lenient decoder), and
// the results match the snprintf spellings the layouts used before, so no stored key changes.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <string>

#include "core/host_name.hpp"
#include "core/text_escape.hpp"

namespace {

using namespace turnstile::detail;

bool letters_only(unsigned char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

std::string every_byte() {
  std::string bytes;
  for (int c = 0; c < 256; ++c) bytes += static_cast<char>(c);
  return bytes;
}

TEST(TextEscape, HexDigitValuesOfBothCasesAndNothingElse) {
  EXPECT_EQ(hex_digit_value('0'), 0);
  EXPECT_EQ(hex_digit_value('9'), 9);
  EXPECT_EQ(hex_digit_value('a'), 10);
  EXPECT_EQ(hex_digit_value('F'), 15);
  for (const char c : {'g', 'G', '/', ':', '@', '`', ' ', '\0', '\xff'}) EXPECT_EQ(hex_digit_value(c), -1) << int(c);
}

TEST(TextEscape, EscapedBytesSpellAsSnprintfDid) {
  for (int c = 0; c < 256; ++c) {
    char expected[8];
    std::snprintf(expected, sizeof expected, "%%%02X", c);
    std::string out;
    append_escaped_byte(out, static_cast<unsigned char>(c));
    EXPECT_EQ(out, expected);
    std::snprintf(expected, sizeof expected, "%02x", c);
    out.clear();
    append_hex_byte(out, static_cast<unsigned char>(c), HexCase::lower);
    EXPECT_EQ(out, expected);
  }
  std::string consul;
  append_escaped_byte(consul, '.', ',');
  EXPECT_EQ(consul, ",2E");
}

TEST(TextEscape, HexNumbersAsPrintfWritesThem) {
  for (const std::uint64_t value : {std::uint64_t{0}, std::uint64_t{1}, std::uint64_t{0xabc}, std::uint64_t{1} << 63,
                                    ~std::uint64_t{0}, std::uint64_t{0x694d7a5b3c2e1f00}}) {
    char expected[24];
    std::snprintf(expected, sizeof expected, "%" PRIx64, value);
    EXPECT_EQ(hex_number(value), expected);
    std::snprintf(expected, sizeof expected, "%016" PRIX64, value);
    EXPECT_EQ(hex_number(value, 16, HexCase::upper), expected);
    std::snprintf(expected, sizeof expected, "%016" PRIx64, value);  // etcd's request marker keys
    EXPECT_EQ(hex_number(value, 16, HexCase::lower), expected);
  }
  EXPECT_EQ(hex_number(0x7f, 4), "007f");
  EXPECT_EQ(hex_number(0x12345, 2), "12345");  // a width never cuts digits
}

TEST(TextEscape, EveryByteRoundTrips) {
  const auto bytes = every_byte();
  const auto encoded = percent_encode(bytes, letters_only);
  EXPECT_EQ(encoded.find_first_not_of("%0123456789ABCDEFabcdefghijklmnopqrstuvwxyzGHIJKLMNOPQRSTUVWXYZ"),
            std::string::npos);
  EXPECT_EQ(encoded.size(), 52 + 3 * (256 - 52));
  EXPECT_EQ(percent_decode(encoded), bytes);
  EXPECT_EQ(percent_decode_lenient(encoded), bytes);
  EXPECT_EQ(percent_encode("a b%", letters_only), "a%20b%25");
  EXPECT_EQ(percent_encode("a.b", letters_only, ','), "a,2Eb");
  EXPECT_EQ(percent_encode("", letters_only), "");
}

TEST(TextEscape, MalformedEscapesAreRefused) {
  for (const char* text : {"%", "%4", "a%4", "%g1", "%1g", "%%41", "x%"}) {
    EXPECT_EQ(percent_decode(text), std::nullopt) << text;
  }
  EXPECT_EQ(percent_decode("%41%62c"), "Abc");
  EXPECT_EQ(percent_decode(""), "");
  EXPECT_EQ(percent_decode("%00"), std::string(1, '\0'));
}

TEST(TextEscape, TheLenientDecoderKeepsWhatIsNoEscape) {
  EXPECT_EQ(percent_decode_lenient("100%"), "100%");
  EXPECT_EQ(percent_decode_lenient("%4"), "%4");
  EXPECT_EQ(percent_decode_lenient("%zz%41"), "%zzA");
  EXPECT_EQ(percent_decode_lenient("%%41"), "%A");
  EXPECT_EQ(percent_decode_lenient("h%C3%A9"), "h\xC3\xA9");
}

TEST(HostName, IsWhatGethostnameSays) {
  char expected[257] = {};
  ASSERT_EQ(gethostname(expected, sizeof expected - 1), 0);
  const auto name = host_name();
  EXPECT_EQ(name, expected);
  EXPECT_FALSE(name.empty());
  EXPECT_EQ(name.find('\0'), std::string::npos);
}

}  // namespace
