// SPDX-License-Identifier: Apache-2.0
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
// An election candidate's side key, + NAME/<lease hex>_<join's request number> (a new key per
// join: a put never re-creates a key left behind; a client's second candidate's own key is
// NAME/<that same suffix>): "<pid> <host> <since ms>" on the lease, put
// by the join's Txn (so its create revision is the entry's) and deleted with the entry. The entry itself holds the
// candidate's value raw, as concurrency.Election writes it, so only this key tells a
// turnstile candidate from another writer's key; it lies outside NAME/, so peers never see it.
inline const std::string kCandidatePrefix = "\x1fturnstile/candidates/";
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
  // Kept after its release (release_after): "turnstile-kept <until ms> <kind> ...", the writer's
  // estimate of when its lease of its own (which etcd expires) ends. 0: not kept.
  std::int64_t kept_until_ms = 0;
  std::string value;       // as stored (an election candidate's value)
  bool candidate = false;  // a turnstile election candidate (its side key was read with it)
};

// The value of a kept entry: `value` (an entry_value) marked as kept until `until_ms`.
std::string kept_value(const std::string& value, std::int64_t until_ms);

// `identity` is "<pid> <host>", `label_suffix` " <holder label>" or "".
std::string entry_value(EntryKind kind, std::int64_t permits, std::int64_t limit, const std::string& identity,
                        std::uint64_t request, const std::string& label_suffix);
// The holder label a value ends with, after the space that follows its last number.
std::string label_after(std::istringstream& text);
EntryKey parse_entry(const mvccpb::KeyValue& kv);
// The mode a queue has from its head, as `inspect` names it: a turnstile candidate's or a
// foreign key with a value (concurrency.Election's proposal; concurrency.Mutex writes none) is
// an election's.
QueueMode queue_mode(const EntryKey& head);
// The mode the head gives a contender of `request`'s primitive: a foreign key is what the
// contender itself is (an etcdctl lock and an etcdctl elect run one algorithm), a turnstile
// candidate an election's, and a turnstile entry its own.
QueueMode queue_mode_for(const EntryKey& head, Primitive primitive);
// The side key of a candidate's join (`request`) on `lease_hex` in the queue under `prefix`
// (NAME/); candidate_key(prefix) is the prefix of them all.
std::string candidate_key(const std::string& prefix, const std::string& lease_hex = "", std::uint64_t request = 0);
std::string candidate_info(const std::string& identity);
// Marks the entries whose side key (in `side`, a range of candidate_key(prefix, "")) was
// created with them: exclusive, with the pid, host and since of their side key.
void mark_candidates(std::vector<EntryKey>& entries, const pb::RangeResponse& side, const std::string& prefix);
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
