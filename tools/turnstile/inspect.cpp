// `turnstile inspect`: the holders and waiters of a name, as a table or one JSON object.
#include <ctime>
#include <cstdio>
#include <iostream>
#include <string_view>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "common.hpp"

namespace turnstile::cli {
namespace {

// ISO 8601 in UTC with milliseconds: 2024-05-01T10:00:00.123Z.
std::string iso8601(std::chrono::system_clock::time_point when) {
  const auto ms = std::chrono::floor<std::chrono::milliseconds>(when.time_since_epoch());
  const auto seconds = std::chrono::floor<std::chrono::seconds>(ms);
  const std::time_t t = seconds.count();
  std::tm utc{};
  gmtime_r(&t, &utc);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", utc.tm_year + 1900, utc.tm_mon + 1,
                utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec, static_cast<int>((ms - seconds).count()));
  return buf;
}

// The length of the well-formed UTF-8 sequence at text[i] (RFC 3629: no overlong forms, no
// surrogates, nothing above U+10FFFF), or 0.
std::size_t utf8_length(std::string_view text, std::size_t i, char32_t& code_point) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char lead = byte(i);
  std::size_t length;
  unsigned char low = 0x80, high = 0xBF;  // the allowed range of the second byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) low = 0xA0;
    if (lead == 0xED) high = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) low = 0x90;
    if (lead == 0xF4) high = 0x8F;
  } else {
    return 0;
  }
  if (i + length > text.size() || byte(i + 1) < low || byte(i + 1) > high) return 0;
  code_point = lead & (0x7F >> length);
  for (std::size_t k = 1; k < length; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    code_point = (code_point << 6) | (byte(i + k) & 0x3F);
  }
  return length;
}

// Characters a terminal acts on or that reorder or hide text: C0 and C1 controls, DEL, and
// Unicode's invisible formatting marks (zero-width, bidirectional overrides, line separators).
bool invisible(char32_t c) {
  return c < 0x20 || (c >= 0x7F && c <= 0x9F) || (c >= 0x200B && c <= 0x200F) || (c >= 0x2028 && c <= 0x202E) ||
         (c >= 0x2060 && c <= 0x2069) || c == 0xFEFF;
}

// Text from the backend — written by any peer — as shown on a terminal: each control or
// formatting character becomes \u{...}, each byte that is not UTF-8 \xNN, and a backslash \\,
// so no peer can move the cursor, recolour or hide a row, and the escapes are unambiguous.
std::string printable(std::string_view text) {
  std::string out;
  char escape[16];
  for (std::size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    char32_t code_point = c;
    const std::size_t length = c < 0x80 ? 1 : utf8_length(text, i, code_point);
    if (length == 0) {
      std::snprintf(escape, sizeof escape, "\\x%02x", c);
      out += escape;
      ++i;
    } else if (invisible(code_point)) {
      std::snprintf(escape, sizeof escape, "\\u{%x}", static_cast<unsigned>(code_point));
      out += escape;
      i += length;
    } else {
      if (c == '\\') out += '\\';
      out.append(text.substr(i, length));
      i += length;
    }
  }
  return out;
}

nlohmann::ordered_json entries_json(const std::vector<EntryInfo>& entries) {
  auto out = nlohmann::ordered_json::array();
  for (const auto& e : entries) {
    out.push_back({{"fencing_token", e.fencing_token},
                   {"kind", e.kind},
                   {"permits", e.permits},
                   {"pid", e.pid},
                   {"host", e.host},
                   {"since", iso8601(e.since)}});
  }
  return out;
}

void print_json(const Inspection& q) {
  nlohmann::ordered_json out = {{"name", q.name},
                        {"mode", q.mode},
                        {"limit", q.mode == "semaphore" ? nlohmann::ordered_json(q.limit) : nlohmann::ordered_json(nullptr)},
                        {"permits", q.permits ? nlohmann::ordered_json(*q.permits) : nlohmann::ordered_json(nullptr)},
                        {"holders", entries_json(q.holders)},
                        {"waiters", entries_json(q.waiters)}};
  // Bytes that are not UTF-8 (a peer may write anything) become U+FFFD instead of an exception;
  // control characters are escaped by JSON itself.
  std::cout << out.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) << '\n';
}

void print_table(const Inspection& q) {
  std::printf("name     %s\n", printable(q.name).c_str());
  if (q.mode.empty()) {
    std::printf("mode     (nobody queued)\n");
  } else if (q.mode == "semaphore") {
    std::printf("mode     semaphore, limit %lld\n", static_cast<long long>(q.limit));
  } else {
    std::printf("mode     %s\n", printable(q.mode).c_str());
  }
  if (q.permits) std::printf("permits  %lld\n", static_cast<long long>(*q.permits));
  if (q.holders.empty() && q.waiters.empty()) return;
  std::printf("%-8s %-10s %-10s %-8s %-25s %-8s %s\n", "ROLE", "TOKEN", "KIND", "PERMITS", "SINCE", "PID", "HOST");
  const auto rows = [](const char* role, const std::vector<EntryInfo>& entries) {
    for (const auto& e : entries) {
      std::printf("%-8s %-10llu %-10s %-8lld %-25s %-8lld %s\n", role, static_cast<unsigned long long>(e.fencing_token),
                  printable(e.kind).c_str(), static_cast<long long>(e.permits), iso8601(e.since).c_str(),
                  static_cast<long long>(e.pid), printable(e.host).c_str());
    }
  };
  rows("holder", q.holders);
  rows("waiter", q.waiters);
}

}  // namespace

int inspect_command(const InspectOptions& options) {
  try {
    auto client = connect_backend(options.backend);
    const auto inspection = client.inspect(options.name);
    if (options.json) {
      print_json(inspection);
    } else {
      print_table(inspection);
    }
    return 0;
  } catch (const Error& error) {
    complain(error.what());
    return exit_status_for(error);
  }
}

}  // namespace turnstile::cli
