// SPDX-License-Identifier: Apache-2.0
#include "backends/consul/keys.hpp"

#include <algorithm>
#include <cctype>
#include <iterator>

#include "core/text_escape.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail::consul {
namespace {

// The root of every key turnstile keeps for itself (queue_prefix and the others below).
constexpr std::string_view kOwnRoot = "turnstile";

bool kept(unsigned char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
         c == '.' || c == '/';
}

// What a request path carries as it is: a key's own alphabet, its ',' escapes included.
bool kept_in_a_path(unsigned char c) { return kept(c) || c == ','; }

// Endings Consul's validateKVKey refuses (agent/kvs_endpoint.go): what proxies might cache.
constexpr std::string_view kFileEndings[] = {
    "js",  "css",  "html", "htm", "xml", "json", "txt", "log", "php",  "asp",   "jsp", "cgi",  "pl",  "py",
    "rb",  "sh",   "exe",  "dll", "bat", "cmd",  "com", "scr", "vbs",  "pdf",   "doc", "docx", "xls", "xlsx",
    "ppt", "pptx", "zip",  "rar", "tar", "gz",   "7z",  "bz2", "jpg",  "jpeg",  "png", "gif",  "svg", "ico",
    "bmp", "mp3",  "mp4",  "avi", "mov", "wmv",  "flv", "swf", "woff", "woff2", "ttf", "eot",  "otf"};

bool file_ending(std::string_view tail) {
  std::string lower(tail);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return std::find(std::begin(kFileEndings), std::end(kFileEndings), lower) != std::end(kFileEndings);
}

// Whether the '.' at name[i] must be escaped. Consul 1.21.5 (hashicorp/consul PR #22682,
// backported to 1.18-1.21) refuses any KV-endpoint key containing ".." (HTTP 500 "invalid key
// name"); later releases refuse "../" and keys that start or end with "..". So no key holds two
// dots in a row: a '.' right after a kept '.' is escaped ("a..b" -> "a.,2Eb"). And, as ever, a
// '.' before a '/' (the first characters of a queue entry's key after the name's).
bool dot_refused(std::string_view name, std::size_t i, std::string_view out) {
  if (i + 1 < name.size() && name[i + 1] == '/') return true;
  return !out.empty() && out.back() == '.';
}

// api.Semaphore keeps PREFIX/.lock and PREFIX/<session id> under its prefix: a name whose last
// segment looks like either would be another name's Semaphore key (Mutex "col/.lock" is
// Semaphore "col"'s `.lock`). Such a segment gets its first character escaped, so no name's key
// ends in one. A segment ".lock" anywhere is escaped alike (one rule, easy to state).
bool session_id_shaped(std::string_view segment) {
  if (segment.size() != 36) return false;
  for (std::size_t i = 0; i < segment.size(); ++i) {
    const char c = segment[i];
    const bool dash_place = i == 8 || i == 13 || i == 18 || i == 23;
    if (dash_place ? c != '-' : !((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

bool starts_reserved_segment(std::string_view name, std::size_t i) {
  if (i > 0 && name[i - 1] != '/') return false;
  const auto end = std::min(name.find('/', i), name.size());
  const auto segment = name.substr(i, end - i);
  return segment == ".lock" || (end == name.size() && session_id_shaped(segment));
}

int base64_value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

std::string base64_decode(std::string_view text) {
  std::string out;
  unsigned buffer = 0;
  int bits = 0;
  for (char c : text) {
    const int v = base64_value(c);
    if (v < 0) continue;  // '=' padding
    buffer = (buffer << 6) | static_cast<unsigned>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((buffer >> bits) & 0xFF);
    }
  }
  return out;
}

KvEntry entry_of(const nlohmann::json& kv) {
  KvEntry entry;
  entry.key = kv.value("Key", "");
  if (const auto v = kv.find("Value"); v != kv.end() && v->is_string())
    entry.value = base64_decode(v->get<std::string>());
  if (const auto s = kv.find("Session"); s != kv.end() && s->is_string()) entry.session = s->get<std::string>();
  entry.flags = kv.value("Flags", std::uint64_t{0});
  entry.create_index = kv.value("CreateIndex", std::uint64_t{0});
  entry.modify_index = kv.value("ModifyIndex", std::uint64_t{0});
  return entry;
}

}  // namespace

std::string encode_name(std::string_view name) {
  const auto last_dot = name.rfind('.');
  const bool dot_starts_ending = last_dot != std::string_view::npos &&
                                 name.find('/', last_dot) == std::string_view::npos &&
                                 file_ending(name.substr(last_dot + 1));
  std::string out;
  for (std::size_t i = 0; i < name.size(); ++i) {
    const auto c = static_cast<unsigned char>(name[i]);
    if (!kept(c) || (c == '.' && dot_refused(name, i, out)) || (dot_starts_ending && i == last_dot) ||
        starts_reserved_segment(name, i)) {
      append_escaped_byte(out, c, ',');
    } else {
      out += static_cast<char>(c);
    }
  }
  // turnstile's own keys (queues, counters, lines, markers) live under turnstile/: a name whose
  // key would be there or be that prefix itself (a Semaphore reads NAME/ whole) could reach
  // another name's state, so it is refused before anything is read or written.
  if (out == kOwnRoot || out.compare(0, kOwnRoot.size() + 1, std::string(kOwnRoot) + "/") == 0) {
    throw InvalidArgument("the name '" + std::string(name) + "' is refused on Consul: keys under " +
                          std::string(kOwnRoot) + "/ are turnstile's own");
  }
  return out;
}

std::string queue_prefix(std::string_view name) { return "turnstile/q/" + encode_name(name) + "/"; }
std::string counter_key(std::string_view name) { return "turnstile/c/" + encode_name(name); }
std::string line_prefix(std::string_view name) { return "turnstile/cq/" + encode_name(name) + "/"; }
std::string occupancy_key(std::string_view name) { return "turnstile/o/" + encode_name(name); }
std::string marker_key(std::string_view entry_id) { return "turnstile/x/" + std::string(entry_id); }

std::vector<KvEntry> parse_entries(const nlohmann::json& array) {
  std::vector<KvEntry> entries;
  if (!array.is_array()) return entries;
  for (const auto& kv : array) {
    if (kv.is_object()) entries.push_back(entry_of(kv));
  }
  return entries;
}

namespace {

// The entries of a GET /v1/kv answer as nlohmann's SAX parser reads them: the fields of each
// object directly in the top-level array; anything nested deeper is skipped.
class EntriesReader {
 public:
  using json = nlohmann::json;
  std::vector<KvEntry> entries;

  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(json::number_integer_t value) {
    if (value >= 0) number(static_cast<std::uint64_t>(value));
    return true;
  }
  bool number_unsigned(json::number_unsigned_t value) {
    number(value);
    return true;
  }
  bool number_float(json::number_float_t, const json::string_t&) { return true; }
  bool binary(json::binary_t&) { return true; }
  bool string(json::string_t& text) {
    if (!in_entry()) return true;
    if (field_ == "Key") entry_.key = std::move(text);
    else if (field_ == "Value") entry_.value = base64_decode(text);
    else if (field_ == "Session") entry_.session = std::move(text);
    return true;
  }
  bool start_object(std::size_t) {
    if (++depth_ == 2 && top_is_array_) entry_ = KvEntry{};
    return true;
  }
  bool end_object() {
    if (depth_-- == 2 && top_is_array_) entries.push_back(std::move(entry_));
    return true;
  }
  bool start_array(std::size_t) {
    if (++depth_ == 1) top_is_array_ = true;
    return true;
  }
  bool end_array() {
    --depth_;
    return true;
  }
  bool key(json::string_t& name) {
    if (depth_ == 2) field_ = std::move(name);
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) { return false; }

 private:
  bool in_entry() const { return depth_ == 2 && top_is_array_; }
  void number(std::uint64_t value) {
    if (!in_entry()) return;
    if (field_ == "Flags") entry_.flags = value;
    else if (field_ == "CreateIndex") entry_.create_index = value;
    else if (field_ == "ModifyIndex") entry_.modify_index = value;
  }

  int depth_ = 0;
  bool top_is_array_ = false;
  std::string field_;
  KvEntry entry_;
};

}  // namespace

std::vector<KvEntry> parse_entries(std::string_view text) {
  EntriesReader reader;
  if (!nlohmann::json::sax_parse(text, &reader)) return {};
  return std::move(reader.entries);
}

std::vector<KvEntry> parse_txn_results(const nlohmann::json& answer) {
  std::vector<KvEntry> entries;
  const auto results = answer.find("Results");
  if (results == answer.end() || !results->is_array()) return entries;
  for (const auto& result : *results) {
    if (const auto kv = result.find("KV"); kv != result.end() && kv->is_object()) entries.push_back(entry_of(*kv));
  }
  return entries;
}

std::vector<KvEntry> children(const std::vector<KvEntry>& entries, const std::string& prefix) {
  std::vector<KvEntry> out;
  for (const auto& entry : entries) {
    if (entry.key.size() > prefix.size() && entry.key.compare(0, prefix.size(), prefix) == 0 &&
        entry.key.find('/', prefix.size()) == std::string::npos && entry.create_index != 0) {
      out.push_back(entry);
    }
  }
  std::sort(out.begin(), out.end(), [](const KvEntry& a, const KvEntry& b) { return a.create_index < b.create_index; });
  return out;
}

std::string base64_encode(std::string_view bytes) {
  static constexpr char alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  std::size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const unsigned v = (static_cast<unsigned char>(bytes[i]) << 16) | (static_cast<unsigned char>(bytes[i + 1]) << 8) |
                       static_cast<unsigned char>(bytes[i + 2]);
    for (int shift = 18; shift >= 0; shift -= 6) out += alphabet[(v >> shift) & 63];
  }
  if (const auto rest = bytes.size() - i; rest > 0) {
    unsigned v = static_cast<unsigned char>(bytes[i]) << 16;
    if (rest == 2) v |= static_cast<unsigned char>(bytes[i + 1]) << 8;
    out += alphabet[(v >> 18) & 63];
    out += alphabet[(v >> 12) & 63];
    out += rest == 2 ? alphabet[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

std::string url_escape(std::string_view text) { return percent_encode(text, kept_in_a_path); }

}  // namespace turnstile::detail::consul
