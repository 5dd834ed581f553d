// SPDX-License-Identifier: Apache-2.0
#include "backends/etcd/layout.hpp"

#include <chrono>

#include "core/text_escape.hpp"

namespace turnstile::detail::etcd {

using std::chrono::milliseconds;

// etcdctl's spelling of a lease id in a key: lower-case hex without leading zeros.
std::string lease_hex(std::int64_t lease) { return hex_number(static_cast<std::uint64_t>(lease)); }

bool is_entry_suffix(std::string_view suffix) {
  const auto underscore = suffix.find('_');
  const auto hex = suffix.substr(0, underscore);
  if (hex.empty() || hex.size() > 16) return false;
  for (char c : hex) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  if (underscore == std::string_view::npos) return true;
  const auto number = suffix.substr(underscore + 1);
  if (number.empty() || number.size() > 20) return false;
  for (char c : number) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

// The entry keys of a range over `prefix`, in the range's order.
std::vector<const mvccpb::KeyValue*> children(const pb::RangeResponse& range, const std::string& prefix) {
  std::vector<const mvccpb::KeyValue*> result;
  result.reserve(range.kvs_size());
  for (const auto& kv : range.kvs()) {
    if (kv.key().size() > prefix.size() && kv.key().compare(0, prefix.size(), prefix) == 0 &&
        is_entry_suffix(std::string_view(kv.key()).substr(prefix.size()))) {
      result.push_back(&kv);
    }
  }
  return result;
}

std::int64_t now_ms() {
  return std::chrono::duration_cast<milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// `identity` is "<pid> <host>", `label_suffix` " <holder label>" or "".
std::string entry_value(EntryKind kind, std::int64_t permits, std::int64_t limit, const std::string& identity,
                        std::uint64_t request, const std::string& label_suffix) {
  return "turnstile " + std::string(to_string(kind)) + " " + std::to_string(permits) + " " + std::to_string(limit) +
         " " + identity + " " + std::to_string(now_ms()) + " " + std::to_string(request) + label_suffix;
}

// The holder label a value ends with, after the space that follows its last number.
std::string label_after(std::istringstream& text) {
  std::string rest;
  std::getline(text, rest);
  return rest.size() > 1 && rest[0] == ' ' ? rest.substr(1) : std::string();
}

namespace {
const std::string kMagic = "turnstile";
const std::string kKeptMagic = "turnstile-kept";
}  // namespace

std::string kept_value(const std::string& value, std::int64_t until_ms) {
  if (!value.starts_with(kMagic + " ")) return value;
  return kKeptMagic + " " + std::to_string(until_ms) + value.substr(kMagic.size());
}

EntryKey parse_entry(const mvccpb::KeyValue& kv) {
  EntryKey entry;
  entry.key = kv.key();
  entry.create_revision = kv.create_revision();
  entry.value = kv.value();
  std::istringstream text(kv.value());
  std::string magic, kind;
  std::uint64_t request = 0;
  EntryKey parsed = entry;
  if (text >> magic && magic == kKeptMagic && !(text >> parsed.kept_until_ms)) return entry;
  if (text >> kind >> parsed.permits >> parsed.limit >> parsed.pid >> parsed.host >> parsed.since_ms >> request &&
      (magic == kMagic || magic == kKeptMagic)) {
    parsed.label = label_after(text);
    if (kind == "shared") parsed.kind = EntryKind::shared;
    else if (kind == "lease") parsed.kind = EntryKind::lease;
    else parsed.kind = EntryKind::exclusive;
    parsed.foreign = false;
    return parsed;
  }
  return entry;
}

QueueMode queue_mode(const EntryKey& head) {
  if (head.candidate || (head.foreign && !head.value.empty())) return QueueMode::election;
  return head.kind == EntryKind::lease ? QueueMode::semaphore : QueueMode::lock;
}

QueueMode queue_mode_for(const EntryKey& head, Primitive primitive) {
  if (head.candidate) return QueueMode::election;
  if (head.foreign) return primitive == Primitive::election ? QueueMode::election : QueueMode::lock;
  return head.kind == EntryKind::lease ? QueueMode::semaphore : QueueMode::lock;
}

std::string candidate_key(const std::string& prefix, const std::string& lease_hex, std::uint64_t request) {
  return kCandidatePrefix + prefix + (lease_hex.empty() ? "" : lease_hex + "_" + std::to_string(request));
}

std::string candidate_info(const std::string& identity) { return identity + " " + std::to_string(now_ms()); }

void mark_candidates(std::vector<EntryKey>& entries, const pb::RangeResponse& side, const std::string& prefix) {
  const auto side_prefix = candidate_key(prefix);
  for (const auto* kv : children(side, side_prefix)) {
    const auto suffix = kv->key().substr(side_prefix.size());
    const auto hex = suffix.substr(0, suffix.find('_'));
    for (auto& entry : entries) {
      // The key is NAME/<hex>, or NAME/<hex>_<n> for a client's second candidate (its side
      // key's own suffix).
      const bool same_key = entry.key == prefix + hex || entry.key == prefix + suffix;
      if (entry.create_revision != kv->create_revision() || !same_key) continue;
      // Whatever the value reads as (a proposal may spell a turnstile entry): a candidate.
      EntryKey candidate;
      candidate.key = entry.key;
      candidate.create_revision = entry.create_revision;
      candidate.value = entry.value;
      candidate.candidate = true;
      candidate.foreign = false;
      std::istringstream text(kv->value());
      text >> candidate.pid >> candidate.host >> candidate.since_ms;
      entry = std::move(candidate);
    }
  }
}

pb::RangeRequest queue_range(const std::string& prefix, std::int64_t max_create_revision) {
  pb::RangeRequest range;
  range.set_key(prefix);
  range.set_range_end(prefix_end(prefix));
  range.set_sort_order(pb::RangeRequest::ASCEND);
  range.set_sort_target(pb::RangeRequest::CREATE);
  range.set_max_create_revision(max_create_revision);
  return range;
}

pb::RangeRequest key_range(const std::string& key) {
  pb::RangeRequest range;
  range.set_key(key);
  return range;
}

pb::Compare* add_compare(pb::TxnRequest& txn, const std::string& key, pb::Compare::CompareTarget target,
                         std::int64_t value) {
  auto* compare = txn.add_compare();
  compare->set_key(key);
  compare->set_result(pb::Compare::EQUAL);
  compare->set_target(target);
  if (target == pb::Compare::CREATE) compare->set_create_revision(value);
  else if (target == pb::Compare::MOD) compare->set_mod_revision(value);
  else compare->set_version(value);
  return compare;
}

// The Txn applies only while `key` holds exactly `value` (never while it does not exist).
void add_value_compare(pb::TxnRequest& txn, const std::string& key, const std::string& value) {
  auto* compare = txn.add_compare();
  compare->set_key(key);
  compare->set_result(pb::Compare::EQUAL);
  compare->set_target(pb::Compare::VALUE);
  compare->set_value(value);
}

void add_put(google::protobuf::RepeatedPtrField<pb::RequestOp>* ops, const std::string& key, const std::string& value,
             std::int64_t lease) {
  auto* put = ops->Add()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
  put->set_lease(lease);
}

void add_delete(google::protobuf::RepeatedPtrField<pb::RequestOp>* ops, const std::string& key) {
  ops->Add()->mutable_request_delete_range()->set_key(key);
}

void add_range(google::protobuf::RepeatedPtrField<pb::RequestOp>* ops, const pb::RangeRequest& range) {
  *ops->Add()->mutable_request_range() = range;
}

// Deletes `key` only while it is the entry created at `revision`: a late or resent delete
// never removes a newer entry that reuses the key (etcd-io/etcd#22082).
pb::TxnRequest delete_entry_txn(const std::string& key, std::int64_t revision) {
  pb::TxnRequest txn;
  add_compare(txn, key, pb::Compare::CREATE, revision);
  add_delete(txn.mutable_success(), key);
  return txn;
}

std::vector<EntryKey> entries_of(const pb::RangeResponse& range, const std::string& prefix) {
  std::vector<EntryKey> entries;
  for (const auto* kv : children(range, prefix)) entries.push_back(parse_entry(*kv));
  return entries;
}

std::vector<QueueEntryView> views_of(const std::vector<EntryKey>& entries, std::size_t up_to) {
  std::vector<QueueEntryView> views;
  for (std::size_t i = 0; i <= up_to && i < entries.size(); ++i) views.push_back({entries[i].kind, entries[i].permits});
  return views;
}

CounterValue counter_value(const pb::RangeResponse& range) {
  CounterValue result;
  if (range.kvs_size() == 0) return result;
  result.mod_revision = range.kvs(0).mod_revision();
  try {
    result.value = std::stoll(range.kvs(0).value());
  } catch (const std::exception&) {
    throw BackendUnavailable("the PermitCounter key '" + range.kvs(0).key() + "' does not hold a number");
  }
  return result;
}

}  // namespace turnstile::detail::etcd
