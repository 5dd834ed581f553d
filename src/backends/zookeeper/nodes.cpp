// SPDX-License-Identifier: Apache-2.0
#include "backends/zookeeper/nodes.hpp"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <random>
#include <string_view>

#include "core/host_name.hpp"
#include "core/text_escape.hpp"

namespace turnstile::detail::zookeeper {

using std::chrono::milliseconds;

std::string random_uuid() {
  thread_local std::mt19937_64 random{std::random_device{}()};
  thread_local pid_t seeded_in = getpid();
  if (seeded_in != getpid()) {  // a forked child must not repeat its parent's uuids
    random.seed(std::random_device{}());
    seeded_in = getpid();
  }
  const std::uint64_t high = (random() & 0xffffffffffff0fffULL) | 0x0000000000004000ULL;  // version 4
  const std::uint64_t low = (random() & 0x3fffffffffffffffULL) | 0x8000000000000000ULL;   // variant 1
  char text[37];
  std::snprintf(text, sizeof text, "%08x-%04x-%04x-%04x-%012llx", static_cast<unsigned>(high >> 32),
                static_cast<unsigned>((high >> 16) & 0xffff), static_cast<unsigned>(high & 0xffff),
                static_cast<unsigned>(low >> 48), static_cast<unsigned long long>(low & 0xffffffffffffULL));
  return text;
}

std::string marked_uuid() {
  auto uuid = random_uuid();
  return uuid.replace(uuid.size() - 12, 12, kTurnstileMark);
}

bool is_marked(const std::string& uuid) { return uuid.size() == kUuidLength && uuid.ends_with(kTurnstileMark); }

std::string protected_name(const std::string& uuid, const std::string& label) { return "_c_" + uuid + "-" + label; }

namespace {

bool is_uuid(std::string_view text) {
  if (text.size() != kUuidLength) return false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    const bool dash = i == 8 || i == 13 || i == 18 || i == 23;
    if (dash ? c != '-' : !std::isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

}  // namespace

std::optional<EntryNode> parse_entry(const std::string& node) {
  std::string_view rest(node);
  EntryNode entry;
  if (rest.starts_with("_c_")) {
    if (rest.size() < 3 + kUuidLength + 1 || !is_uuid(rest.substr(3, kUuidLength)) || rest[3 + kUuidLength] != '-') {
      return std::nullopt;
    }
    entry.uuid = std::string(rest.substr(3, kUuidLength));
    rest.remove_prefix(3 + kUuidLength + 1);
  }
  if (rest.starts_with(kReadLabel)) {
    entry.kind = EntryKind::shared;
    rest.remove_prefix(std::strlen(kReadLabel));
  } else if (rest.starts_with(kWriteLabel) || rest.starts_with(kMutexLabel)) {
    entry.kind = EntryKind::exclusive;
    rest.remove_prefix(std::strlen(rest.starts_with(kWriteLabel) ? kWriteLabel : kMutexLabel));
  } else if (rest.starts_with(kLatchLabel)) {
    entry.kind = EntryKind::exclusive;
    entry.latch = true;
    rest.remove_prefix(std::strlen(kLatchLabel));
  } else if (rest.starts_with(kLeaseLabel) || rest.starts_with(kWaitLabel)) {
    entry.kind = EntryKind::lease;
    rest.remove_prefix(std::strlen(rest.starts_with(kLeaseLabel) ? kLeaseLabel : kWaitLabel));
  } else {
    return std::nullopt;
  }
  if (rest.size() != kSequenceDigits) return std::nullopt;
  for (const char c : rest) {
    if (c < '0' || c > '9') return std::nullopt;
  }
  std::from_chars(rest.data(), rest.data() + rest.size(), entry.seq);
  entry.node = node;
  return entry;
}

std::vector<EntryNode> sorted_entries(const std::vector<std::string>& children) {
  std::vector<EntryNode> entries;
  entries.reserve(children.size());
  for (const auto& child : children) {
    if (auto entry = parse_entry(child)) entries.push_back(std::move(*entry));
  }
  std::sort(entries.begin(), entries.end(), [](const EntryNode& a, const EntryNode& b) { return a.seq < b.seq; });
  return entries;
}

std::size_t index_of(const std::vector<EntryNode>& entries, const std::string& node) {
  for (std::size_t i = 0; i < entries.size(); ++i) {
    if (entries[i].node == node) return i;
  }
  return entries.size();
}

std::string node_data(const std::string& kind, const std::string& label, std::int64_t permits) {
  static const std::string host = host_name();  // asked once: not a system call per entry
  return "turnstile pid=" + std::to_string(getpid()) + " host=" + host + " kind=" + kind +
         (permits != 1 ? " permits=" + std::to_string(permits) : "") + (label.empty() ? "" : " label=" + label);
}

namespace {

constexpr std::string_view kLabelField = " label=";

// A field of the data before its label (so a label can never pose as another field).
std::string field(const std::string& data, const std::string& key) {
  const std::string_view fields = std::string_view(data).substr(0, data.find(kLabelField));
  const auto at = fields.find(" " + key + "=");
  if (at == std::string::npos) return {};
  const auto start = at + key.size() + 2;
  return std::string(fields.substr(start, fields.find(' ', start) - start));
}

std::optional<std::int64_t> parse_number(const std::string& text) {
  std::int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

}  // namespace

NodeInfo parse_node_data(const std::string& data) {
  NodeInfo info;
  if (!data.starts_with("turnstile ")) {
    info.host = data;  // a Curator node: its client's address
    return info;
  }
  info.host = field(data, "host");
  if (const auto at = data.find(kLabelField); at != std::string::npos)
    info.label = data.substr(at + kLabelField.size());
  const auto pid = field(data, "pid");
  std::from_chars(pid.data(), pid.data() + pid.size(), info.pid);
  info.downgraded = field(data, "kind") == "downgraded";
  const auto permits = field(data, "permits");
  if (!permits.empty()) std::from_chars(permits.data(), permits.data() + permits.size(), info.permits);
  return info;
}

std::optional<std::int64_t> recorded_limit(const std::string& data) {
  if (!data.starts_with("limit=")) return std::nullopt;
  return parse_number(data.substr(6));
}

namespace {

// A name's segment after the first is a child of the node of the name before it (name "a/b"
// lives under name "a"): it must not be mistaken for one of that name's nodes. Such segments
// are the entry patterns of parse_entry and the fixed children of a name's node.
bool looks_like_a_names_node(std::string_view segment) {
  return parse_entry(std::string(segment)).has_value() || segment == "locks" || segment == "leases" ||
         segment == "permits" || segment == "permit-waiters";
}

}  // namespace

std::string encode_name(const std::string& name) {
  std::string path;
  path.reserve(name.size());
  for (std::size_t i = 0; i < name.size();) {
    if (i > 0 && name[i - 1] == '/') {
      const auto end = std::min(name.find('/', i), name.size());
      if (looks_like_a_names_node(std::string_view(name).substr(i, end - i))) {
        append_escaped_byte(path, static_cast<unsigned char>(name[i]));
        ++i;
        continue;
      }
    }
    const auto lead = static_cast<unsigned char>(name[i]);
    const std::size_t length = lead < 0x80 ? 1 : lead >= 0xf0 ? 4 : lead >= 0xe0 ? 3 : lead >= 0xc0 ? 2 : 1;
    std::uint32_t code = length == 1 ? lead : lead & (0x7f >> length);
    for (std::size_t k = 1; k < length && i + k < name.size(); ++k)
      code = (code << 6) | (static_cast<unsigned char>(name[i + k]) & 0x3f);
    const bool refused = lead == '%' || (code >= 0x7f && code <= 0x9f) || (code >= 0xd800 && code <= 0xf8ff) ||
                         (code >= 0xfff0 && code <= 0xffff) || code > 0xffff;
    for (std::size_t k = 0; k < length && i + k < name.size(); ++k) {
      if (refused) {
        append_escaped_byte(path, static_cast<unsigned char>(name[i + k]));
      } else {
        path += name[i + k];
      }
    }
    i += length;
  }
  return path;
}

std::uint64_t token_of(const Stat& stat) {
  if (stat.czxid <= 0) throw BackendUnavailable("ZooKeeper reported no creation zxid for a node of ours");
  return static_cast<std::uint64_t>(stat.czxid);
}

EntryInfo entry_info(const NodeInfo& node, const Stat& stat, std::string kind) {
  EntryInfo info;
  info.fencing_token = stat.czxid > 0 ? static_cast<std::uint64_t>(stat.czxid) : 0;
  info.kind = std::move(kind);
  info.permits = node.permits;
  info.pid = node.pid;
  info.host = node.host;
  info.label = node.label;
  info.since = std::chrono::system_clock::time_point(milliseconds(stat.ctime));
  return info;
}

bool still_writing(const std::string& data) { return !parse_node_data(data).downgraded; }

}  // namespace turnstile::detail::zookeeper
