// SPDX-License-Identifier: Apache-2.0
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

// An election candidate's entry keeps its proposal byte for byte (NUL and bytes past ASCII,
// which JSON text cannot hold as they are); a lock's entry says nothing of elections.
TEST(ConsulLayout, AnElectionEntryKeepsItsProposalBytes) {
  EntryValue value;
  value.election = true;
  value.proposal = std::string("a\0b \xFF 50%", 9);
  const auto json = nlohmann::json::parse(to_json(value));
  EXPECT_EQ(json.at("election"), true);
  const auto back = entry_value(to_json(value));
  EXPECT_TRUE(back.election);
  EXPECT_EQ(back.proposal, value.proposal);
  EXPECT_FALSE(nlohmann::json::parse(to_json(EntryValue{})).contains("election"));
  EXPECT_FALSE(entry_value(to_json(EntryValue{})).election);
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

// A GET /v1/kv answer read from its text (no JSON document) gives what the document gave:
// each object of the top-level array, its Value decoded, nested fields and other types skipped.
TEST(ConsulLayout, EntriesReadFromTheTextAsFromTheDocument) {
  const std::string text =
      R"([{"LockIndex":0,"Key":"turnstile/q/a/s-1","Flags":0,"Value":"eyJrIjoxfQ==","Session":"s",)"
      R"("CreateIndex":12,"ModifyIndex":14},)"
      R"({"Key":"b","Flags":3035920962525813784,"Value":null,"Nested":{"Key":"no","CreateIndex":99},)"
      R"("List":[1,{"Key":"no"}],"CreateIndex":20,"ModifyIndex":21},7,"x"])";
  const auto from_text = turnstile::detail::consul::parse_entries(std::string_view(text));
  const auto from_document = turnstile::detail::consul::parse_entries(nlohmann::json::parse(text));
  ASSERT_EQ(from_text.size(), 2u);
  ASSERT_EQ(from_document.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(from_text[i].key, from_document[i].key);
    EXPECT_EQ(from_text[i].value, from_document[i].value);
    EXPECT_EQ(from_text[i].session, from_document[i].session);
    EXPECT_EQ(from_text[i].flags, from_document[i].flags);
    EXPECT_EQ(from_text[i].create_index, from_document[i].create_index);
    EXPECT_EQ(from_text[i].modify_index, from_document[i].modify_index);
  }
  EXPECT_EQ(from_text[0].value, R"({"k":1})");
  EXPECT_EQ(from_text[1].create_index, 20u);
  EXPECT_TRUE(turnstile::detail::consul::parse_entries(std::string_view("not json")).empty());
  EXPECT_TRUE(turnstile::detail::consul::parse_entries(std::string_view(R"({"Key":"x"})")).empty());
}
