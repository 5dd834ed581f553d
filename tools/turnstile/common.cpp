// SPDX-License-Identifier: Apache-2.0
#include "common.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <iterator>
#include <mutex>
#include <string_view>

#include "acquire.hpp"
#include "core/bounded_write.hpp"
#include "core/text_escape.hpp"

namespace turnstile::cli {

std::string iso8601(std::chrono::system_clock::time_point when) {
  const auto ms = std::chrono::floor<std::chrono::milliseconds>(when.time_since_epoch());
  const auto seconds = std::chrono::floor<std::chrono::seconds>(ms);
  const std::time_t t = seconds.count();
  std::tm utc{};
  gmtime_r(&t, &utc);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", utc.tm_year + 1900, utc.tm_mon + 1, utc.tm_mday,
                utc.tm_hour, utc.tm_min, utc.tm_sec, static_cast<int>((ms - seconds).count()));
  return buf;
}

// Given up when stderr has not taken it within a second (a pipe nobody reads, a stopped terminal
// reader): turnstile must not wait on its own messages while it should stop or release.
void complain(const std::string& message) {
  // Messages come from the main thread and from the event hook's (-v): one at a time, and a
  // line cut short is ended before the next, which starts on a line of its own.
  static std::mutex order;
  static bool torn = false;
  std::lock_guard lock(order);
  const std::string line = (torn ? "\nturnstile: " : "turnstile: ") + message + "\n";
  const auto written = detail::write_within(STDERR_FILENO, line, std::chrono::seconds(1));
  if (written > 0) torn = written < line.size();
}

int exit_status_for(const Error& error) {
  switch (error.code()) {
    case ErrorCode::invalid_argument:
    case ErrorCode::invalid_url:
    case ErrorCode::backend_not_built:
    // The name is in use in another mode or with another limit: the invocation has to change.
    case ErrorCode::kind_mismatch:
    case ErrorCode::limit_mismatch: return kExitUsage;
    case ErrorCode::access_denied: return kExitNoPermission;
    default: return kExitUnavailable;
  }
}

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

std::string name_problem(std::string_view name) {
  constexpr std::size_t kMaxLength = 255;
  const std::string quoted = "'" + printable(name) + "'";
  if (name.empty()) return "invalid name: it is empty";
  if (name.size() > kMaxLength) {
    return "invalid name: it is " + std::to_string(name.size()) + " bytes long, the limit is " +
           std::to_string(kMaxLength);
  }
  if (name.front() == '/' || name.back() == '/') return "invalid name: " + quoted + " starts or ends with '/'";
  for (std::size_t i = 0; i < name.size();) {
    const auto c = static_cast<unsigned char>(name[i]);
    if (c < 0x20 || c == 0x7F) return "invalid name: it contains the control character " + std::to_string(c);
    char32_t code_point = c;
    const std::size_t length = c < 0x80 ? 1 : utf8_length(name, i, code_point);
    if (length == 0) return "invalid name: it is not valid UTF-8 at byte " + std::to_string(i);
    i += length;
  }
  for (std::size_t start = 0; start <= name.size();) {
    const auto end = std::min(name.find('/', start), name.size());
    const auto segment = name.substr(start, end - start);
    if (segment.empty()) return "invalid name: " + quoted + " has an empty segment";
    if (segment == "." || segment == "..") return "invalid name: " + quoted + " has a '.' or '..' segment";
    start = end + 1;
  }
  return {};
}

// Characters a terminal acts on or that reorder or hide text: C0 and C1 controls, DEL, the line
// and paragraph separators, the interlinear annotation marks, and every code point Unicode
// calls Default_Ignorable (DerivedCoreProperties.txt: zero-width and bidirectional marks, the
// soft hyphen, variation selectors, Hangul fillers, tags...), which a terminal draws as nothing,
// so that two names that differ only by them look alike (red team rt29b B3).
static bool invisible(char32_t c) {
  struct Range {
    char32_t first, last;
  };
  static constexpr Range kInvisible[] = {{0x0000, 0x001F},   {0x007F, 0x009F},   {0x00AD, 0x00AD},  {0x034F, 0x034F},
                                         {0x061C, 0x061C},   {0x115F, 0x1160},   {0x17B4, 0x17B5},  {0x180B, 0x180F},
                                         {0x200B, 0x200F},   {0x2028, 0x202E},   {0x2060, 0x206F},  {0x3164, 0x3164},
                                         {0xFE00, 0xFE0F},   {0xFEFF, 0xFEFF},   {0xFFA0, 0xFFA0},  {0xFFF0, 0xFFFB},
                                         {0x1BCA0, 0x1BCA3}, {0x1D173, 0x1D17A}, {0xE0000, 0xE0FFF}};
  return std::any_of(std::begin(kInvisible), std::end(kInvisible),
                     [c](const Range& range) { return c >= range.first && c <= range.last; });
}

// Text from the backend — written by any peer — as shown on a terminal: each control or
// formatting character becomes \u{...}, each byte that is not UTF-8 \xNN, and a backslash \\,
// so no peer can move the cursor, recolour or hide a row, and the escapes are unambiguous.
std::string printable(std::string_view text) {
  std::string out;
  for (std::size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    char32_t code_point = c;
    const std::size_t length = c < 0x80 ? 1 : utf8_length(text, i, code_point);
    if (length == 0) {
      out += "\\x";
      detail::append_hex_byte(out, c, detail::HexCase::lower);
      ++i;
    } else if (invisible(code_point)) {
      out += "\\u{" + detail::hex_number(code_point) + "}";
      i += length;
    } else {
      if (c == '\\') out += '\\';
      out.append(text.substr(i, length));
      i += length;
    }
  }
  return out;
}

std::string describe_errno(const std::string& what) { return what + ": " + std::strerror(errno); }

std::string backend_shown(const Client& client) {
  const std::string& url = client.url();
  const auto scheme_end = url.find("://");
  const auto scheme = url.substr(0, scheme_end);
  if ((scheme != "consul" && scheme != "consuls") || scheme_end == std::string::npos) return url;
  const auto after = url.substr(scheme_end + 3);
  if (!after.empty() && after.front() != '/' && after.front() != '?') return url;  // it names its agent
  const char* env = std::getenv("CONSUL_HTTP_ADDR");
  if (!env || !*env) return url + " (the agent at 127.0.0.1:8500, Consul's default)";
  std::string address = env;
  // A user:password@ in it is no one's business on a terminal.
  if (const auto at = address.rfind('@'); at != std::string::npos) {
    const auto scheme_part = address.find("://");
    address = (scheme_part != std::string::npos && scheme_part < at ? address.substr(0, scheme_part + 3) : "") +
              address.substr(at + 1);
  }
  return url + " (the agent at " + printable(address) + ", from CONSUL_HTTP_ADDR)";
}

void say_release_unconfirmed(Client& client, const std::string& what, const Error& error) {
  if (dynamic_cast<const KeepUnconfirmed*>(&error) != nullptr) {  // the library's words are the whole story
    complain("the hold on " + what + " (--hold-at-least): " + error.what());
    return;
  }
  // The library's words are for a client that lives on ("retried in the background"); this one
  // is exiting, so only the cause is kept.
  std::string cause = error.what();
  const std::string retried = "retried in the background: ";
  if (const auto at = cause.find(retried); at != std::string::npos) cause = cause.substr(at + retried.size());
  complain("the release of " + what + " was not confirmed (" + cause +
           "); it is tried once more as turnstile exits, and otherwise the server frees it when the hold's TTL "
           "or session runs out");
  client.set_error_handler([](const Error&) {});  // that last try's give-up was just told
}

Client connect_backend(const std::optional<std::string>& url, ClientOptions options) {
  return url ? Client::connect(*url, std::move(options)) : Client::connect(std::move(options));
}

}  // namespace turnstile::cli
