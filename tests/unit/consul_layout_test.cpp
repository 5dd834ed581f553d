// What the Consul backend stores and asks for, spelled byte for byte (src/backends/consul/keys.cpp
// and layout.cpp, compiled in): entry values keep a holder's host and label as ASCII with %XX
// for '%' and bytes past ASCII (JSON needs UTF-8, a host name need not be), read back leniently;
// request paths escape a key's bytes with upper-case %XX. The key layout of names is pinned
// against the server by tests/consul/consul_keys_test.cpp.
#include <gtest/gtest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "backends/consul/keys.hpp"
#include "backends/consul/layout.hpp"

namespace {

using namespace turnstile::detail::consul;

TEST(ConsulLayout, RequestPathsEscapeAllButTheKeysAlphabet) {
  EXPECT_EQ(url_escape("turnstile/q/a.,2Eb/s-1"), "turnstile/q/a.,2Eb/s-1");
  EXPECT_EQ(url_escape("a b%?#&=+\xC3\xA9\x01"), "a%20b%25%3F%23%26%3D%2B%C3%A9%01");
  EXPECT_EQ(url_escape(""), "");
}

TEST(ConsulLayout, NamesEscapeWithACommaAndUpperCaseDigits) {
  EXPECT_EQ(encode_name("a b"), "a,20b");
  EXPECT_EQ(encode_name("caf\xC3\xA9"), "caf,C3,A9");
  EXPECT_EQ(encode_name("100%"), "100,25");
}

TEST(ConsulLayout, HostAndLabelKeepAsciiAndEscapePercentAndHighBytes) {
  EntryValue value;
  value.host = "h\xE9%1.example";
  value.label = "job \xC3\xA9 100%";
  const auto json = nlohmann::json::parse(to_json(value));
  EXPECT_EQ(json.at("host"), "h%E9%251.example");
  EXPECT_EQ(json.at("label"), "job %C3%A9 100%25");
  const auto back = entry_value(to_json(value));
  EXPECT_EQ(back.host, value.host);
  EXPECT_EQ(back.label, value.label);
}

TEST(ConsulLayout, AHostWrittenByAPeerIsReadLeniently) {
  const auto read = [](const std::string& host) { return entry_value(nlohmann::json{{"host", host}}.dump()).host; };
  EXPECT_EQ(read("plain"), "plain");
  EXPECT_EQ(read("100%"), "100%");
  EXPECT_EQ(read("%4"), "%4");
  EXPECT_EQ(read("%zz%41"), "%zzA");
  EXPECT_EQ(read("h%e9"), "h\xE9");
}

}  // namespace
