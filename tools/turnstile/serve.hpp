// SPDX-License-Identifier: Apache-2.0
// `turnstile serve`: what a backend shows (names in use, holders, waiters) as Prometheus
// metrics and a live web page, read by one thread that polls the backend and shared by every
// request.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <turnstile/turnstile.hpp>

namespace turnstile::cli {

struct ServeOptions {
  std::optional<std::string> backend;
  std::string listen = "127.0.0.1:9464";
  bool allow_remote = false;        // else a non-loopback --listen is refused
  std::string prefix;               // only names starting with it
  std::size_t max_names = 100;      // names looked at per poll (1 to 10000)
  bool name_label = false;          // per-name metric series (at most kMaxNameSeries names)
  double interval_sec = 0.5;        // between looks at the backend
  double connect_timeout_sec = 10;  // connecting to the backend
  std::size_t max_live_pages = 16;  // SSE streams open at once
};
int serve_command(const ServeOptions& options);

// Per-name series in /metrics stop at this many names, whatever --max-names says: a scrape's
// size and the series' count stay bounded.
inline constexpr std::size_t kMaxNameSeries = 100;

// Where to listen: an IP address (or "localhost") and a port (0: any free one).
struct ListenAddress {
  std::string host;  // as the socket layer takes it: "127.0.0.1", "::1", "0.0.0.0"
  int port = 0;
  bool loopback = false;
};
// Parses HOST:PORT or [IPV6]:PORT; throws InvalidArgument saying what is wrong.
ListenAddress parse_listen_address(std::string_view text);
// Whether a request's Host header names this host's loopback (the anti-DNS-rebinding check).
bool host_header_is_loopback(const std::string& host_header);
// "127.0.0.1:8080" or "[::1]:8080": how the address is written back in messages and URLs.
std::string address_text(const std::string& host, int port);

// One look at the backend: the queues of the names in use, in name order.
struct ServedState {
  std::string backend;  // Client::url(): credentials hidden
  std::string prefix;
  std::chrono::system_clock::time_point taken{};  // when the look finished
  std::vector<Inspection> queues;
  bool truncated = false;  // more names were in use than looked at
  std::string error;       // why the last look failed ("" when it succeeded)
  std::uint64_t polls = 0;
  std::uint64_t failed_polls = 0;
};

// Seconds since `since` at `now` (0 when since is unknown: the epoch, as foreign holders give).
double seconds_since(std::chrono::system_clock::time_point since, std::chrono::system_clock::time_point now);
// "4 s", "2 min 05 s", "3 h 07 min", "2 d 04 h": an age as the page shows it.
std::string age_text(double seconds);

// The page's parts (serve_page.cpp). The fragment is what the live stream sends: the state
// without the page around it, on one line per table row.
std::string html_escape(std::string_view text);
std::string render_state_fragment(const ServedState& state);
std::string render_page(const ServedState& state);
// /state.json; `live_pages`: the event streams open now.
std::string render_state_json(const ServedState& state, std::size_t live_pages);
// /metrics' gauges of what the backend shows (serve_metrics.cpp), at `now`.
std::string render_backend_metrics(const ServedState& state, bool per_name, std::size_t live_pages,
                                   std::chrono::system_clock::time_point now);

}  // namespace turnstile::cli
