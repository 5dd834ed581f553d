// SPDX-License-Identifier: Apache-2.0
// The ZooKeeper backend, laid out as Apache Curator 5's lock recipes lay out their nodes, so
// turnstile and Curator contenders on one path exclude each other in one FIFO queue:
//
//   name "a/b" -> path ROOT/a/b (ROOT: the URL's chroot). Parents are container nodes.
//   Mutex, RecursiveMutex   ROOT/a/b/_c_<uuid>-lock-<seq>      (Curator InterProcessMutex)
//   SharedMutex             ROOT/a/b/_c_<uuid>-__READ__<seq>   (InterProcessReadWriteLock)
//                           ROOT/a/b/_c_<uuid>-__WRIT__<seq>   (writers)
//   Semaphore(limit)        ROOT/a/b/locks/_c_<uuid>-lock-<seq>  the line (a mutex)
//                           ROOT/a/b/leases/_c_<uuid>-lease-<seq> one per permit held
//                           (InterProcessSemaphoreV2); ROOT/a/b's data records the limit
//   Election                ROOT/a/b/_c_<uuid>-latch-<seq>     (Curator LeaderLatch; data: the
//                           candidate's value, raw; turnstile's uuids end in kTurnstileMark)
//   PermitCounter           ROOT/a/b/permits (the count, changed by versioned set)
//                           ROOT/a/b/permit-waiters/_c_<uuid>-wait-<seq> (the line)
//
// Every entry is an ephemeral sequential node: it dies with its session, so nothing leaks
// when a process dies. Entries are ordered by their 10-digit sequence suffix (the parent's
// counter, shared by every kind of child), as Curator orders them. The fencing token is not
// that number (it restarts when the server reaps the empty container parent) but the node's
// czxid, the zxid of the transaction that created it (see token_of). A waiter
// watches only the entry it waits for, with getData (a watch on a missing node is never set).
// The `_c_<uuid>-` prefix is Curator's "protection": after a connection loss during create,
// the contender finds its node by the prefix instead of creating a second one, and checks the
// node's ephemeral owner is its own session (CURATOR-604).
#pragma once

#include <zookeeper/zookeeper.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/backend.hpp"

namespace turnstile::detail::zookeeper {

inline constexpr const char* kMutexLabel = "lock-";
inline constexpr const char* kReadLabel = "__READ__";
inline constexpr const char* kWriteLabel = "__WRIT__";
inline constexpr const char* kLeaseLabel = "lease-";
inline constexpr const char* kWaitLabel = "wait-";
inline constexpr const char* kLatchLabel = "latch-";
inline constexpr std::size_t kSequenceDigits = 10;
inline constexpr std::size_t kUuidLength = 36;

// A version-4 uuid: a Curator protection id (a forked child never repeats its parent's).
std::string random_uuid();
// The last 12 hex digits of the protection id of turnstile's election nodes ("turnst"): a
// Curator LeaderLatch's random uuid ends so with chance 2^-48. A leader's proclaim needs to tell
// who is directly behind it (ZookeeperHold::proclaim).
inline constexpr const char* kTurnstileMark = "7475726e7374";
// A version-4 uuid whose last 12 hex digits are kTurnstileMark.
std::string marked_uuid();
bool is_marked(const std::string& uuid);
// "_c_<uuid>-<label>": the name of a protected node before its sequence suffix.
std::string protected_name(const std::string& uuid, const std::string& label);

// One child of a queue's parent, parsed from its name.
struct EntryNode {
  std::string node;  // the child's name
  std::uint64_t seq = 0;
  EntryKind kind = EntryKind::exclusive;
  std::string uuid;    // the protection id, "" for unprotected nodes
  bool latch = false;  // an election candidate's (LeaderLatch's) node
};

// A queue entry is exactly what Curator names one: [_c_<uuid>-]<label><10 digits>. Anything
// else (the semaphore's `locks`, a nested name's node, a peer's stray node) is not an entry;
// and encode_name never makes a name's node look like one (see there), so one name cannot
// forge another's entries.
std::optional<EntryNode> parse_entry(const std::string& node);
// The entries among a parent's `children`, in queue order (by sequence suffix).
std::vector<EntryNode> sorted_entries(const std::vector<std::string>& children);
// Where `node` is in `entries`; entries.size() when it is not there.
std::size_t index_of(const std::vector<EntryNode>& entries, const std::string& node);

// What our nodes carry: who made them (for inspect), and whether a writer's entry was
// downgraded to a reader's. Curator's nodes carry the client's IP address instead.
struct NodeInfo {
  std::int64_t pid = 0;
  std::string host;
  std::string label;
  bool downgraded = false;
  std::int64_t permits = 1;
};

// "turnstile pid=<pid> host=<host> kind=<kind>[ permits=<n>][ label=<holder label>]": the
// label, free text, comes last and ends the data.
std::string node_data(const std::string& kind, const std::string& label, std::int64_t permits = 1);
// What node_data wrote (or, for a Curator node, its client's address as `host`).
NodeInfo parse_node_data(const std::string& data);

// The semaphore node's data: "limit=N" (turnstile's own record; Curator leaves it empty).
std::optional<std::int64_t> recorded_limit(const std::string& data);

// ZooKeeper refuses in paths the code points Java's PathUtils refuses: U+007F-U+009F,
// U+D800-U+F8FF, U+FFF0-U+FFFF and, as they need UTF-16 surrogates, everything above U+FFFF.
// Their UTF-8 bytes (and '%', so the mapping stays one-to-one) are percent-encoded. So is the
// first byte of a segment (after the first) that looks like a name's own node (looks_like_a_names_node):
// "a/lock-0000000000" is ROOT/a/%6Cock-0000000000, never an entry of "a". Every other name is
// its path unchanged, as Curator users write it.
std::string encode_name(const std::string& name);

// The fencing token of a node of ours: its czxid, the zxid of the transaction that created it.
// zxids grow strictly for the ensemble's life (the leader's epoch in the high 32 bits, a
// counter in the low ones), so a name's tokens keep growing when the server reaps its empty
// container parent and the sequence numbers restart (they did: 1, 2, 3, then 1 again after a
// minute idle). A created node's czxid is positive: as a std::uint64_t it is the same number.
// (A lease hold's nodes are made by one transaction: one czxid.)
std::uint64_t token_of(const Stat& stat);
// What inspect shows of one node: its token, its creator (from its data) and its creation time.
EntryInfo entry_info(const NodeInfo& node, const Stat& stat, std::string kind);
// A writer's node whose data does not say it was downgraded blocks the readers behind it.
bool still_writing(const std::string& data);

}  // namespace turnstile::detail::zookeeper
