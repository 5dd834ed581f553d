// SPDX-License-Identifier: Apache-2.0
// Consul's KV layout for turnstile names: key encoding, the peers' flag values, and the KV
// entries as Consul's JSON answers them (keys.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace turnstile::detail::consul {

// api/lock.go's LockFlagValue and api/semaphore.go's SemaphoreFlagValue: a key written with
// other flags belongs to someone else (ErrLockConflict, ErrSemaphoreConflict).
constexpr std::uint64_t kLockFlags = 0x2ddccbc058a50c18ULL;
constexpr std::uint64_t kSemaphoreFlags = 0xe0f69a2baa414de0ULL;

// A turnstile name as a Consul key. Consul's KV endpoint accepts only letters, digits and
// ",-_./" in keys (1.21.5: also "?&="), never ".." (1.21.5; later ones: no "../", no ".." at a
// key's start or end), and no file-like ending (".json"): every other byte becomes ",XX" (',' is
// the escape, so it is escaped too, and two names never share a key), and so do a '.' right after
// a kept '.' (no key holds ".."), a '.' before a '/', and the '.' that would start such an
// ending. A segment ".lock", or a last segment shaped like a session id, has its first byte
// escaped: those are api.Semaphore's keys under a prefix (PREFIX/.lock, PREFIX/<session>), and
// no Mutex may reach a Semaphore's. A name made of accepted characters that Consul takes as it is
// stays its own key, as `consul lock` writes it.
// Throws InvalidArgument for a name whose key is turnstile/ or under it (turnstile's own keys).
std::string encode_name(std::string_view name);

// Where turnstile keeps what Consul's own clients do not have.
std::string queue_prefix(std::string_view name);  // turnstile/q/<key>/: queue entries
std::string counter_key(std::string_view name);   // turnstile/c/<key>: PermitCounter value
std::string line_prefix(std::string_view name);   // turnstile/cq/<key>/: its waiters
// turnstile/x/<id>, id = <session>-<n> (ConsulBackend::next_id): the request marker of a join
// given up (given_up.hpp) or of a counter change (counter_markers.hpp); never the same n.
std::string marker_key(std::string_view entry_id);
// turnstile/o/<key>: present whenever the name's queue has an entry (every join writes it, so
// its ModifyIndex moves with each); only the last one out deletes it, by CAS on that index
// (occupancy.hpp). Its
// absence lets an exclusive join take the name at once (places.cpp).
std::string occupancy_key(std::string_view name);

// One KV entry as Consul answers it (GET /v1/kv, /v1/txn results), the value decoded.
struct KvEntry {
  std::string key;
  std::string value;
  std::string session;  // the holder, when locked
  std::uint64_t flags = 0;
  std::uint64_t create_index = 0;
  std::uint64_t modify_index = 0;
};

std::vector<KvEntry> parse_entries(const nlohmann::json& array);
// The same from the answer's text, without building its JSON document first (a queue of
// thousands is a few MB of document for a few hundred KB of text). Not JSON: no entries.
std::vector<KvEntry> parse_entries(std::string_view text);
// The KV results of a /v1/txn answer.
std::vector<KvEntry> parse_txn_results(const nlohmann::json& answer);
// Entries directly under `prefix` (not in nested names), by CreateIndex.
std::vector<KvEntry> children(const std::vector<KvEntry>& entries, const std::string& prefix);

std::string base64_encode(std::string_view bytes);
// Percent-encodes a key or a query value for a request path.
std::string url_escape(std::string_view text);

}  // namespace turnstile::detail::consul
