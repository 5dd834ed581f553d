// SPDX-License-Identifier: Apache-2.0
// URLs: every part parsed, malformed ones refused with InvalidUrl, and credentials never in a
// message: parse errors, connect errors of every network scheme and Client::url() show ***.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include <turnstile/turnstile.hpp>

#include "core/backend.hpp"

namespace {

using turnstile::detail::parse_url;
using turnstile::detail::redact_url;

constexpr const char* kSecret = "s3cr3t-Pa55";

TEST(UrlRedaction, PasswordsTokensAndSecretParametersBecomeStars) {
  EXPECT_EQ(redact_url("redis://alice:s3cr3t@127.0.0.1:6379/2?ttl=5"), "redis://alice:***@127.0.0.1:6379/2?ttl=5");
  EXPECT_EQ(redact_url("redis://:s3cr3t@h:1"), "redis://:***@h:1");
  EXPECT_EQ(redact_url("zk://user:pw@h1:2181,h2:2181/root"), "zk://user:***@h1:2181,h2:2181/root");
  EXPECT_EQ(redact_url("consul://tok-123@h:8500?ttl=10"), "consul://***@h:8500?ttl=10");
  // A Consul token is the whole userinfo: a ':' in it shows no part of it (red team, issue 12).
  EXPECT_EQ(redact_url("consul://ab:cd@h:8500"), "consul://***@h:8500");
  EXPECT_EQ(redact_url("CONSULS://ab:cd@h:8500"), "CONSULS://***@h:8500");
  EXPECT_EQ(redact_url("etcd://h:2379?password=x&ttl=3&token=y"), "etcd://h:2379?password=***&ttl=3&token=***");
  // A userinfo without ':' is a password on redis:// (redis://PASSWORD@host): hidden whole.
  EXPECT_EQ(redact_url("redis://S3cretPW@h:1/0"), "redis://***@h:1/0");
  // Unencoded '/', '?', '#' or '@' in a password: the last '@' still ends the userinfo.
  EXPECT_EQ(redact_url("redis://:S3c/retPW@h:1/"), "redis://:***@h:1/");
  EXPECT_EQ(redact_url("redis://u:S3c?ret#PW@h:1"), "redis://u:***@h:1");
  EXPECT_EQ(redact_url("redis://u:S3c@retPW@h:1"), "redis://u:***@h:1");
  EXPECT_EQ(redact_url("file:///tmp/x"), "file:///tmp/x");
  // Malformed: no scheme, stray '@' in the path.
  EXPECT_EQ(redact_url("u:pw@h:1"), "u:***@h:1");
  EXPECT_EQ(redact_url("file:///tmp/a@b"), "file:///tmp/a@b");
}

TEST(UrlRedaction, ParsingKeepsTheCredentialsButShowsThemRedacted) {
  const auto url = parse_url(std::string("redis://alice:") + kSecret + "@127.0.0.1:6379");
  EXPECT_EQ(url.password, kSecret);
  EXPECT_EQ(url.user, "alice");
  EXPECT_EQ(url.text.find(kSecret), std::string::npos);
}

TEST(UrlRedaction, ParseErrorsNeverCarryThePassword) {
  for (const std::string& bad :
       {std::string("redis://u:") + kSecret + "@h:1#frag", std::string("redis://") + kSecret + "@h:1/abc",
        std::string("redis://:") + kSecret + "/x@h:1", std::string("redis://") + kSecret + "@h:1?eviction=x",
        // Refused before connecting: each names a bad part after the host.
        std::string("redis://S3c/") + kSecret + "@127.0.0.1:1/notadb",
        std::string("redis://u:S3c/") + kSecret + "@127.0.0.1:1/x",
        std::string("etcd://u:") + kSecret + "/x@127.0.0.1:1/path",
        std::string("zk://u:") + kSecret + "/x@127.0.0.1:1?bogus=1", std::string("redis://u:") + kSecret + "@h:1?k",
        std::string("redis://u:") + kSecret + "@h:1/%zz", std::string("redis://u:") + kSecret + "@h:99999",
        std::string("nosuch://u:") + kSecret + "@h:1"}) {
    try {
      turnstile::Client::connect(bad);
      ADD_FAILURE() << "connected to a bad URL";
    } catch (const turnstile::Error& error) {
      EXPECT_EQ(std::string(error.what()).find(kSecret), std::string::npos) << error.what();
    }
  }
}

// Every network scheme, pointed at a port where nothing listens (or whose backend is not built):
// the error names the URL without the password.
TEST(UrlRedaction, ConnectErrorsOfEveryNetworkSchemeHideThePassword) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "loads the network backends' libraries (gRPC, abseil), which are not built for ThreadSanitizer";
#endif
  for (const std::string& scheme :
       {std::string("redis"), std::string("zk"), std::string("etcd"), std::string("consul")}) {
    const auto url = scheme + "://user:" + kSecret + "@127.0.0.1:1" + (scheme == "redis" ? "?ttl=1" : "");
    try {
      turnstile::Client::connect(url);
      ADD_FAILURE() << scheme << ": connected to a closed port";
    } catch (const turnstile::Error& error) {
      EXPECT_EQ(std::string(error.what()).find(kSecret), std::string::npos) << scheme << ": " << error.what();
    }
  }
}

}  // namespace

namespace {

struct UrlRow {
  std::string text;
  std::string scheme, user, password, path;
  std::vector<std::string> hosts;
  std::map<std::string, std::string> query;
};

TEST(UrlParsing, EveryPartInOneTable) {
  const std::vector<UrlRow> rows{
      {"file:///tmp/x", "file", "", "", "/tmp/x", {}, {}},
      {"redis://127.0.0.1:6379/2?ttl=5", "redis", "", "", "/2", {"127.0.0.1:6379"}, {{"ttl", "5"}}},
      {"REDIS://u:p%40ss@h:1", "redis", "u", "p@ss", "", {"h:1"}, {}},
      {"zk://a:1,b:2,c:3/chroot/x", "zk", "", "", "/chroot/x", {"a:1", "b:2", "c:3"}, {}},
      {"etcds://h:2379?cacert=%2Fetc%2Fca.pem&ttl=3",
       "etcds",
       "",
       "",
       "",
       {"h:2379"},
       {{"cacert", "/etc/ca.pem"}, {"ttl", "3"}}},
      {"consul://token@h:8500", "consul", "token", "", "", {"h:8500"}, {}},
      // Unencoded '/', '?', '#', '@' in a password: the last '@' ends the userinfo.
      {"redis://u:S3c/re?t#P@W@h:1/2", "redis", "u", "S3c/re?t#P@W", "/2", {"h:1"}, {}},
      {"file:///tmp/a@b", "file", "", "", "/tmp/a@b", {}, {}},
  };
  for (const auto& row : rows) {
    const auto url = parse_url(row.text);
    EXPECT_EQ(url.scheme, row.scheme) << row.text;
    EXPECT_EQ(url.user, row.user) << row.text;
    EXPECT_EQ(url.password, row.password) << row.text;
    EXPECT_EQ(url.path, row.path) << row.text;
    EXPECT_EQ(url.hosts, row.hosts) << row.text;
    EXPECT_EQ(url.query, row.query) << row.text;
  }
}

TEST(UrlParsing, MalformedUrlsAreInvalidUrl) {
  for (const char* bad : {"", "redis", "://h:1", "re dis://h:1", "redis://h:1#x", "redis://h:1?novalue",
                          "redis://h:1?=v", "redis://a:1,,b:2", "redis://h :1", "redis://h:1/%g0", "redis://h:1/%4",
                          // An option given twice (which one would win?), also when percent-encoded.
                          "redis://h:1?eviction=allow&eviction=refuse", "redis://h:1?ttl=5&%74tl=6"}) {
    EXPECT_THROW(parse_url(bad), turnstile::InvalidUrl) << bad;
  }
}

// Hosts are checked the same way for every backend: a bracketed IPv6 address keeps its
// brackets and its port comes after them; anything else malformed is InvalidUrl, never a
// connection attempt that fails later as "unavailable" (red team, issue 12).
TEST(UrlParsing, HostsAndPortsAreCheckedForEveryBackend) {
  using turnstile::detail::parse_host_port;
  const auto url = parse_url("redis://h:1");
  const auto ipv6 = parse_host_port("[::1]:6380", 6379, url);
  EXPECT_EQ(ipv6.host, "[::1]");
  EXPECT_EQ(ipv6.port, 6380);
  EXPECT_EQ(parse_host_port("[::1]", 6379, url).port, 6379);
  EXPECT_EQ(parse_host_port("db-1.example_x", 6379, url).host, "db-1.example_x");
  for (const char* bad : {"[::1", "[::1]x", "[::1]:", "[]:1", "a:b:1", "h:0", "h:65536", "h:x", "h st:1", ":1"}) {
    EXPECT_THROW(parse_host_port(bad, 6379, url), turnstile::InvalidUrl) << bad;
  }
}

// A TTL given as an option has the range the same URL parameter has: both are refused alike.
TEST(UrlParsing, TtlOptionsHaveTheRangeOfTheUrlParameter) {
  using std::chrono::milliseconds;
  using turnstile::detail::check_ttl_option;
  using turnstile::detail::parse_seconds;
  for (const long long ms : {300LL, 1000LL, 86'400'000LL}) {
    EXPECT_NO_THROW(check_ttl_option(milliseconds(ms), 0.3)) << ms;
    EXPECT_NO_THROW(parse_seconds("ttl", std::to_string(ms / 1000.0), 0.3, 86400)) << ms;
  }
  for (const long long ms : {299LL, 86'400'001LL, 1'000'000'000'000LL}) {
    EXPECT_THROW(check_ttl_option(milliseconds(ms), 0.3), turnstile::InvalidArgument) << ms;
    EXPECT_THROW(parse_seconds("ttl", std::to_string(ms / 1000.0), 0.3, 86400), turnstile::InvalidUrl) << ms;
  }
  EXPECT_NO_THROW(check_ttl_option(milliseconds(0), 0.3));  // not set: the backend's default
}

}  // namespace
