// SPDX-License-Identifier: Apache-2.0
// `turnstile serve`'s text, its sources compiled in: --listen's parsing and loopback rule, the
// page's escaping of what peers wrote, and /metrics' label escaping, per-name cap and ages.
// (tests/serve drives the real process with a browser and Prometheus' parser.)
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "serve.hpp"

namespace {

using turnstile::EntryInfo;
using turnstile::Inspection;
using turnstile::InvalidArgument;
using namespace turnstile::cli;
using namespace std::chrono_literals;

TEST(ServeListen, LoopbackAddressesAreLoopback) {
  for (const char* text : {"127.0.0.1:9464", "127.1.2.3:0", "[::1]:80", "[::ffff:127.0.0.1]:1", "localhost:65535"}) {
    const auto address = parse_listen_address(text);
    EXPECT_TRUE(address.loopback) << text;
  }
  EXPECT_EQ(parse_listen_address("localhost:8080").host, "127.0.0.1");
  EXPECT_EQ(parse_listen_address("[::1]:8080").host, "::1");
  EXPECT_EQ(parse_listen_address("127.0.0.1:0").port, 0);
}

TEST(ServeListen, OtherAddressesAreNot) {
  for (const char* text : {"0.0.0.0:9464", "[::]:9464", "192.168.1.10:80", "10.0.0.1:1", "[::ffff:10.0.0.1]:1",
                           "[fe80::1]:80", "128.0.0.1:80"}) {
    const auto address = parse_listen_address(text);
    EXPECT_FALSE(address.loopback) << text;
  }
}

TEST(ServeListen, MalformedAddressesAreRefusedSayingWhy) {
  const auto problem = [](const char* text) {
    try {
      parse_listen_address(text);
    } catch (const InvalidArgument& error) {
      return std::string(error.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(problem("127.0.0.1").find("HOST:PORT"), std::string::npos);
  EXPECT_NE(problem("127.0.0.1:65536").find("0 (any free port) to 65535"), std::string::npos);
  EXPECT_NE(problem("127.0.0.1:-1").find("port"), std::string::npos);
  EXPECT_NE(problem("127.0.0.1:80x").find("port"), std::string::npos);
  EXPECT_NE(problem("127.0.0.1:").find("port"), std::string::npos);
  EXPECT_NE(problem("::1:80").find("brackets"), std::string::npos);
  EXPECT_NE(problem("[::1]80").find("[IPV6-ADDRESS]:PORT"), std::string::npos);
  EXPECT_NE(problem("example.org:80").find("IP address or localhost"), std::string::npos);
  EXPECT_NE(problem("lo\ncal:80").find("\\u{a}"), std::string::npos);  // spelled, not printed raw
}

TEST(ServeListen, APortIsDigitsOnly) {
  // from_chars takes a sign: "-0" read as port 0 before the port was checked digit by digit.
  for (const char* text : {"127.0.0.1:-0", "127.0.0.1:+80", "127.0.0.1: 80", "127.0.0.1:80 ", "[::1]:-0",
                           "127.0.0.1:0x50", "127.0.0.1:99999999999"}) {
    EXPECT_THROW(parse_listen_address(text), InvalidArgument) << text;
  }
  EXPECT_EQ(parse_listen_address("127.0.0.1:00080").port, 80);
}

TEST(ServeHostHeader, LoopbackNamesWithOrWithoutAPortAreLoopback) {
  for (const char* host : {"localhost", "localhost:9464", "127.0.0.1", "127.0.0.1:80", "127.9.8.7:65535", "[::1]",
                           "[::1]:9464", "[::ffff:127.0.0.1]:1",
                           // Host names are case-insensitive; the trailing dot is the root (rt29 F3).
                           "LOCALHOST", "Localhost:9464", "localhost.", "localhost.:80"}) {
    EXPECT_TRUE(host_header_is_loopback(host)) << host;
  }
}

// rt29 F4: the address parser stopped at a NUL byte, so "127.0.0.1\0.evil.example" passed.
TEST(ServeHostHeader, ACharacterNoHostIsSpelledWithIsNotLoopback) {
  for (const std::string& host :
       {std::string("127.0.0.1\0.evil.example", 23), std::string("localhost\0", 10), std::string("[::1%lo]"),
        std::string("[::1%25lo]:80"), std::string("127.0.0.1\t"), std::string("localhost.."), std::string(".localhost"),
        std::string("a..localhost"), std::string("evillocalhost"), std::string("localhost.evil")}) {
    EXPECT_FALSE(host_header_is_loopback(host)) << host;
  }
}

TEST(ServeHostHeader, AnythingButHostAndDigitsPortIsNotLoopback) {
  // A browser sends userinfo or a path nowhere in Host; a header that has them is forged, and
  // "127.0.0.1:1@evil.com" must not pass for 127.0.0.1.
  for (const char* host : {"127.0.0.1:1@evil.com",
                           "evil.com@127.0.0.1",
                           "user@localhost",
                           "127.0.0.1:",
                           "[::1]:",
                           "127.0.0.1:80/x",
                           "127.0.0.1 :80",
                           " 127.0.0.1",
                           "127.0.0.1:8 0",
                           "127.0.0.1:-1",
                           "127.0.0.1:65536",
                           "127.0.0.1:80:80",
                           "[::1]x",
                           "[::1]:80x",
                           "[127.0.0.1]:80",
                           "[::1",
                           "localhost.evil.com",
                           "evil.com",
                           "",
                           ":80",
                           "::1",
                           "10.0.0.1:80",
                           "[::2]:80"}) {
    EXPECT_FALSE(host_header_is_loopback(host)) << host;
  }
}

TEST(ServeListen, AddressTextPutsIpv6InBrackets) {
  EXPECT_EQ(address_text("127.0.0.1", 80), "127.0.0.1:80");
  EXPECT_EQ(address_text("::1", 80), "[::1]:80");
}

TEST(ServePage, EscapesHtmlMetacharacters) {
  EXPECT_EQ(html_escape("a<b>&\"c'"), "a&lt;b&gt;&amp;&quot;c&#39;");
  EXPECT_EQ(html_escape("plain/name"), "plain/name");
}

TEST(ServePage, AgesReadAsMinutesHoursAndDays) {
  EXPECT_EQ(age_text(0), "0 s");
  EXPECT_EQ(age_text(59.9), "59 s");
  EXPECT_EQ(age_text(125), "2 min 05 s");
  EXPECT_EQ(age_text(3 * 3600 + 7 * 60), "3 h 07 min");
  EXPECT_EQ(age_text(2 * 86400 + 4 * 3600), "2 d 04 h");
}

ServedState state_with(const std::string& name, const std::string& label, int holders, int waiters,
                       std::chrono::system_clock::time_point now) {
  Inspection queue;
  queue.name = name;
  queue.mode = "lock";
  for (int i = 0; i < holders + waiters; ++i) {
    EntryInfo entry;
    entry.fencing_token = 100 + static_cast<std::uint64_t>(i);
    entry.kind = "exclusive";
    entry.pid = 4242;
    entry.host = "host<1>";
    entry.label = label;
    entry.since = now - std::chrono::seconds(10 * (i + 1));
    entry.holding = i < holders;
    (entry.holding ? queue.holders : queue.waiters).push_back(entry);
  }
  ServedState state;
  state.backend = "redis://user:***@127.0.0.1:6379";
  state.taken = now;
  state.polls = 1;
  state.queues.push_back(queue);
  return state;
}

TEST(ServePage, TheFragmentEscapesNamesLabelsAndHosts) {
  const auto now = std::chrono::system_clock::now();
  const auto fragment = render_state_fragment(state_with("jobs/<b>&\"x'", "label <i>", 1, 2, now));
  EXPECT_NE(fragment.find("jobs/&lt;b&gt;&amp;&quot;x&#39;"), std::string::npos);
  EXPECT_NE(fragment.find("label &lt;i&gt;"), std::string::npos);
  EXPECT_NE(fragment.find("4242@host&lt;1&gt;"), std::string::npos);
  EXPECT_EQ(fragment.find("<b>"), std::string::npos);
  EXPECT_EQ(fragment.find("<i>"), std::string::npos);
  // Holders first, then waiters numbered in queue order.
  EXPECT_LT(fragment.find("<tr class=\"holder\">"), fragment.find("<tr class=\"waiter\"><td>1</td>"));
  EXPECT_LT(fragment.find("<td>1</td><td class=\"token\">101"), fragment.find("<td>2</td><td class=\"token\">102"));
}

TEST(ServePage, ThePageNamesTheBackendAsShownAndFollowsTheStream) {
  const auto page = render_page(state_with("a", "", 1, 0, std::chrono::system_clock::now()));
  EXPECT_NE(page.find("redis://user:***@127.0.0.1:6379"), std::string::npos);
  EXPECT_NE(page.find("new EventSource('events')"), std::string::npos);
  EXPECT_EQ(page.find("src=\"http"), std::string::npos);  // nothing loaded from elsewhere
}

TEST(ServeMetrics, NameLabelsAreEscapedAndCapped) {
  const auto now = std::chrono::system_clock::now();
  auto state = state_with("q\"uo\\te", "", 1, 1, now);
  const auto text = render_backend_metrics(state, true, 0, now);
  EXPECT_NE(text.find("turnstile_backend_name_holders{name=\"q\\\"uo\\\\te\"} 1"), std::string::npos) << text;
  // A name with a control character (a peer's key) is spelled out rather than break the scrape.
  auto odd = state_with("bad\x01name", "", 1, 0, now);
  EXPECT_NE(render_backend_metrics(odd, true, 0, now).find("{name=\"bad\\\\u{1}name\"}"), std::string::npos);
  for (std::size_t i = 0; i < kMaxNameSeries + 20; ++i) state.queues.push_back(state.queues.front());
  const auto many = render_backend_metrics(state, true, 0, now);
  std::size_t series = 0;
  for (auto at = many.find("\nturnstile_backend_name_waiters{"); at != std::string::npos;
       at = many.find("\nturnstile_backend_name_waiters{", at + 1)) {
    ++series;
  }
  EXPECT_EQ(series, kMaxNameSeries);
  EXPECT_EQ(render_backend_metrics(state, false, 0, now).find("name="), std::string::npos);
}

TEST(ServeMetrics, LongestHoldAndWaitComeFromTheEntriesStarts) {
  const auto now = std::chrono::system_clock::now();
  // The holder started 10 s ago, the waiters 20 s and 30 s ago.
  const auto text = render_backend_metrics(state_with("a", "", 1, 2, now), false, 3, now);
  EXPECT_NE(text.find("turnstile_backend_longest_hold_seconds 10\n"), std::string::npos) << text;
  EXPECT_NE(text.find("turnstile_backend_longest_wait_seconds 30\n"), std::string::npos) << text;
  EXPECT_NE(text.find("turnstile_backend_holders 1\n"), std::string::npos);
  EXPECT_NE(text.find("turnstile_backend_waiters 2\n"), std::string::npos);
  EXPECT_NE(text.find("turnstile_serve_live_pages 3\n"), std::string::npos);
  EXPECT_NE(text.find("turnstile_backend_up 1\n"), std::string::npos);
}

}  // namespace
