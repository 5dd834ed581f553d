// How the etcd backend lays out its keys and values, and the request builders every part of it
// uses: a name's queue entries (NAME/<lease hex>[_<n>]), the PermitCounter's key and waiters,
// the release receipts, and the Txn pieces made from them.
#pragma once

#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "backends/etcd/connection.hpp"
#include "core/queue.hpp"

namespace turnstile::detail::etcd {

constexpr std::size_t kMaxReceiptsPerTxn = 16;

// Keys of turnstile's own outside every queue prefix: names cannot contain control characters.
inline const std::string kCounterPrefix = "\x1fturnstile/permits/";
inline const std::string kCounterWaiterPrefix = "\x1fturnstile/permit-waiters/";
inline const std::string kReceiptPrefix = "\x1fturnstile/released/";  // + <lease hex>_<create revision>
// A take's marker holds this once the take applied, kRefused once its leave retired it.
inline const std::string kTaken = "taken";
inline const std::string kRefused = "refused";
inline const std::string kReturned = "returned";  // applied after the acquire reported it not taken: undone
// A counter change's (add, try_set, drain) marker holds this once the change applied.
inline const std::string kApplied = "applied";

std::string lease_hex(std::int64_t lease);
std::int64_t now_ms();

// A name's entries are its keys NAME/<lease hex> (etcdctl lock's) and NAME/<lease hex>_<n>:
// only direct children of NAME/ with exactly this syntax count, so the keys of another name
// (NAME/x/..., or NAME/<hex>/... of a name that itself looks like an entry key) are never
// taken for entries of NAME.
bool is_entry_suffix(std::string_view suffix);
// The entry keys of a range over `prefix`, in the range's order.
std::vector<const mvccpb::KeyValue*> children(const pb::RangeResponse& range, const std::string& prefix);

// One queue entry as stored: "turnstile <kind> <permits> <limit> <pid> <host> <since ms>
// <request>[ <label>]" (the request number makes each join's value unique). Anything else —
// etcdctl lock's empty value — is an exclusive entry of a foreign contender.
struct EntryKey {
  std::string key;
  std::int64_t create_revision = 0;
  EntryKind kind = EntryKind::exclusive;
  std::int64_t permits = 1;
  std::int64_t limit = 0;
  std::int64_t pid = 0;
  std::string host;
  std::int64_t since_ms = 0;
  std::string label;
  bool foreign = true;  // not written by turnstile (etcdctl lock's empty value, or anything else)
};

// `identity` is "<pid> <host>", `label_suffix` " <holder label>" or "".
std::string entry_value(EntryKind kind, std::int64_t permits, std::int64_t limit, const std::string& identity,
                        std::uint64_t request, const std::string& label_suffix);
// The holder label a value ends with, after the space that follows its last number.
std::string label_after(std::istringstream& text);
EntryKey parse_entry(const mvccpb::KeyValue& kv);
QueueMode queue_mode(const EntryKey& head);
std::vector<EntryKey> entries_of(const pb::RangeResponse& range, const std::string& prefix);
std::vector<QueueEntryView> views_of(const std::vector<EntryKey>& entries, std::size_t up_to);

// --- request builders ----------------------------------------------------------------------

pb::RangeRequest queue_range(const std::string& prefix, std::int64_t max_create_revision = 0);
pb::RangeRequest key_range(const std::string& key);
pb::Compare* add_compare(pb::TxnRequest& txn, const std::string& key, pb::Compare::CompareTarget target,
                         std::int64_t value);
// The Txn applies only while `key` holds exactly `value` (never while it does not exist).
void add_value_compare(pb::TxnRequest& txn, const std::string& key, const std::string& value);
void add_put(google::protobuf::RepeatedPtrField<pb::RequestOp>* ops, const std::string& key, const std::string& value,
             std::int64_t lease);
void add_delete(google::protobuf::RepeatedPtrField<pb::RequestOp>* ops, const std::string& key);
void add_range(google::protobuf::RepeatedPtrField<pb::RequestOp>* ops, const pb::RangeRequest& range);
// Deletes `key` only while it is the entry created at `revision`: a late or resent delete
// never removes a newer entry that reuses the key (etcd-io/etcd#22082).
pb::TxnRequest delete_entry_txn(const std::string& key, std::int64_t revision);

struct CounterValue {
  std::optional<std::int64_t> value;
  std::int64_t mod_revision = 0;  // 0 while the key does not exist
};

CounterValue counter_value(const pb::RangeResponse& range);

}  // namespace turnstile::detail::etcd
