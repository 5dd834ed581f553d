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
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstring>
#include <limits>
#include <random>
#include <thread>
#include <utility>

#include "backends/zookeeper/session.hpp"

namespace turnstile::detail::zookeeper {
namespace {

constexpr const char* kMutexLabel = "lock-";
constexpr const char* kReadLabel = "__READ__";
constexpr const char* kWriteLabel = "__WRIT__";
constexpr const char* kLeaseLabel = "lease-";
constexpr const char* kWaitLabel = "wait-";
constexpr std::size_t kSequenceDigits = 10;
constexpr std::size_t kUuidLength = 36;

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

std::string host_name() {
  char buffer[256] = {};
  gethostname(buffer, sizeof buffer - 1);
  return buffer;
}

// One child of a queue's parent, parsed from its name.
struct EntryNode {
  std::string node;  // the child's name
  std::uint64_t seq = 0;
  EntryKind kind = EntryKind::exclusive;
  std::string uuid;  // the protection id, "" for unprotected nodes
};

bool is_uuid(std::string_view text) {
  if (text.size() != kUuidLength) return false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    const bool dash = i == 8 || i == 13 || i == 18 || i == 23;
    if (dash ? c != '-' : !std::isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

// A queue entry is exactly what Curator names one: [_c_<uuid>-]<label><10 digits>. Anything
// else (the semaphore's `locks`, a nested name's node, a peer's stray node) is not an entry;
// and encode_name never makes a name's node look like one (see there), so one name cannot
// forge another's entries.
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
std::string node_data(const std::string& kind, const std::string& label, std::int64_t permits = 1) {
  static const std::string host = host_name();  // asked once: not a system call per entry
  return "turnstile pid=" + std::to_string(getpid()) + " host=" + host + " kind=" + kind +
         (permits != 1 ? " permits=" + std::to_string(permits) : "") + (label.empty() ? "" : " label=" + label);
}

constexpr std::string_view kLabelField = " label=";

// A field of the data before its label (so a label can never pose as another field).
std::string field(const std::string& data, const std::string& key) {
  const std::string_view fields = std::string_view(data).substr(0, data.find(kLabelField));
  const auto at = fields.find(" " + key + "=");
  if (at == std::string::npos) return {};
  const auto start = at + key.size() + 2;
  return std::string(fields.substr(start, fields.find(' ', start) - start));
}

NodeInfo parse_node_data(const std::string& data) {
  NodeInfo info;
  if (!data.starts_with("turnstile ")) {
    info.host = data;  // a Curator node: its client's address
    return info;
  }
  info.host = field(data, "host");
  if (const auto at = data.find(kLabelField); at != std::string::npos) info.label = data.substr(at + kLabelField.size());
  const auto pid = field(data, "pid");
  std::from_chars(pid.data(), pid.data() + pid.size(), info.pid);
  info.downgraded = field(data, "kind") == "downgraded";
  const auto permits = field(data, "permits");
  if (!permits.empty()) std::from_chars(permits.data(), permits.data() + permits.size(), info.permits);
  return info;
}

std::optional<std::int64_t> parse_number(const std::string& text) {
  std::int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

// A count as a peer may have written it: any integer. Exact in 128 bits up to 38 digits; of a
// longer one only the sign is kept (`exact` false): drain resets it, nothing else changes it.
struct Count {
  __int128 value = 0;
  bool exact = true;
};

std::optional<Count> parse_count(const std::string& text) {
  std::string_view digits(text);
  const bool negative = digits.starts_with('-');
  if (negative) digits.remove_prefix(1);
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  while (digits.size() > 1 && digits.front() == '0') digits.remove_prefix(1);
  Count count;
  if (digits.size() > 38) {
    count.exact = false;
    count.value = 1;
    for (int i = 0; i < 38; ++i) count.value *= 10;
  } else {
    for (const char c : digits) count.value = count.value * 10 + (c - '0');
  }
  if (negative) count.value = -count.value;
  return count;
}

std::string count_text(__int128 value) {
  const bool negative = value < 0;
  unsigned __int128 magnitude = negative ? -static_cast<unsigned __int128>(value) : static_cast<unsigned __int128>(value);
  std::string text;
  do {
    text.insert(text.begin(), static_cast<char>('0' + static_cast<int>(magnitude % 10)));
    magnitude /= 10;
  } while (magnitude != 0);
  return negative ? "-" + text : text;
}

// What the API returns of a count: counts beyond 64 bits (a peer's) as the nearest 64-bit one
// ("at least INT64_MAX permits"); every count written is exact.
std::int64_t saturated(__int128 value) {
  constexpr auto high = std::numeric_limits<std::int64_t>::max();
  constexpr auto low = std::numeric_limits<std::int64_t>::min();
  return value > high ? high : value < low ? low : static_cast<std::int64_t>(value);
}

// The count a node holds; a node that does not hold one (a peer's, or data too large to read)
// is refused rather than overwritten.
Count count_of(const std::string& text, const std::string& name) {
  const auto count = parse_count(text);
  if (!count) throw BackendUnavailable("the PermitCounter node of '" + name + "' does not hold a number");
  return *count;
}

// Refuses to change a count of more than 38 digits (a peer's): its new value cannot be written
// exactly. drain_permits() resets it.
void require_exact(const Count& count, const std::string& name) {
  if (!count.exact) {
    throw InvalidArgument("PermitCounter '" + name + "' holds a count of more than 38 digits, which cannot be changed " +
                          "exactly; drain_permits() resets it. Nothing changed");
  }
}

// The semaphore node's data: "limit=N" (turnstile's own record; Curator leaves it empty).
std::optional<std::int64_t> recorded_limit(const std::string& data) {
  if (!data.starts_with("limit=")) return std::nullopt;
  return parse_number(data.substr(6));
}

// A name's segment after the first is a child of the node of the name before it (name "a/b"
// lives under name "a"): it must not be mistaken for one of that name's nodes. Such segments
// are the entry patterns of parse_entry and the fixed children of a name's node.
bool looks_like_a_names_node(std::string_view segment) {
  return parse_entry(std::string(segment)).has_value() || segment == "locks" || segment == "leases" ||
         segment == "permits" || segment == "permit-waiters";
}

// ZooKeeper refuses in paths the code points Java's PathUtils refuses: U+007F-U+009F,
// U+D800-U+F8FF, U+FFF0-U+FFFF and, as they need UTF-16 surrogates, everything above U+FFFF.
// Their UTF-8 bytes (and '%', so the mapping stays one-to-one) are percent-encoded. So is the
// first byte of a segment (after the first) that looks like a name's own node (see above):
// "a/lock-0000000000" is ROOT/a/%6Cock-0000000000, never an entry of "a". Every other name is
// its path unchanged, as Curator users write it.
std::string encode_name(const std::string& name) {
  std::string path;
  path.reserve(name.size());
  for (std::size_t i = 0; i < name.size();) {
    if (i > 0 && name[i - 1] == '/') {
      const auto end = std::min(name.find('/', i), name.size());
      if (looks_like_a_names_node(std::string_view(name).substr(i, end - i))) {
        char escaped[4];
        std::snprintf(escaped, sizeof escaped, "%%%02X", static_cast<unsigned char>(name[i]));
        path += escaped;
        ++i;
        continue;
      }
    }
    const auto lead = static_cast<unsigned char>(name[i]);
    const std::size_t length = lead < 0x80 ? 1 : lead >= 0xf0 ? 4 : lead >= 0xe0 ? 3 : lead >= 0xc0 ? 2 : 1;
    std::uint32_t code = length == 1 ? lead : lead & (0x7f >> length);
    for (std::size_t k = 1; k < length && i + k < name.size(); ++k) code = (code << 6) | (static_cast<unsigned char>(name[i + k]) & 0x3f);
    const bool refused = lead == '%' || (code >= 0x7f && code <= 0x9f) || (code >= 0xd800 && code <= 0xf8ff) ||
                         (code >= 0xfff0 && code <= 0xffff) || code > 0xffff;
    for (std::size_t k = 0; k < length && i + k < name.size(); ++k) {
      if (refused) {
        char escaped[4];
        std::snprintf(escaped, sizeof escaped, "%%%02X", static_cast<unsigned char>(name[i + k]));
        path += escaped;
      } else {
        path += name[i + k];
      }
    }
    i += length;
  }
  return path;
}


bool past(Deadline deadline) { return deadline && SteadyClock::now() >= *deadline; }

// ---- The one place where ZooKeeper's answers become exceptions ----

// Thrown inside the backend when its session went away. It never leaves the backend: a queue
// step makes it QueueEntryGone (our ephemeral entry went with the session: the core joins again,
// on a new one), any other call BackendUnavailable.
struct SessionGone {};

void check_session(const Session& session, int rc) {
  if (session_gone(rc) || session.expired()) throw SessionGone{};
}

// A call given up at its bound while the connection was down (a BackendUnavailable to anyone
// but a waiter's look, which waits through the outage: EntryPlace::through_outages).
struct ConnectionGaveUp : BackendUnavailable {
  using BackendUnavailable::BackendUnavailable;
};

// `what` answered with `rc` (not ZOK, the session alive). `consequence` says what became of the
// call's effects, where that is not obvious.
[[noreturn]] void throw_error(const std::string& what, int rc, const std::string& consequence = "") {
  if (rc == ZNOAUTH || rc == ZAUTHFAILED) throw AccessDenied("ZooKeeper refused " + what + ": " + zerror(rc));
  throw BackendUnavailable("ZooKeeper " + what + " failed: " + zerror(rc) + consequence);
}

// A call that failed with `rc` and will not be tried again: the stop of its bound ends the step
// (CallStopped), else it is the server's or the link's error.
[[noreturn]] void give_up(const CallBound& bound, const std::string& what, int rc) {
  if (bound.stopped()) throw CallStopped{};
  if (connection_trouble(rc)) throw ConnectionGaveUp("ZooKeeper " + what + " failed: " + zerror(rc));
  throw_error(what, rc);
}

// A change whose reply was lost and whose effect could not be read back in time.
[[noreturn]] void unconfirmed(const std::string& what, const std::string& consequence) {
  throw BackendUnavailable("ZooKeeper did not confirm " + what + " in time: " + consequence);
}

// Runs one step of a queue or counter line. A step that its stop ended is presented as our
// entry gone: the core, seeing the stop, gives up (and leaves) instead of joining again.
template <class Step>
auto queue_step(Step&& step) {
  try {
    return step();
  } catch (const SessionGone&) {
    throw QueueEntryGone{};
  } catch (const CallStopped&) {
    throw QueueEntryGone{};
  }
}

// Runs a call that is no queue step (inspect, the counter's changes).
template <class Call>
auto outside_queue(const std::string& what, Call&& call) {
  try {
    return call();
  } catch (const SessionGone&) {
    throw BackendUnavailable("the ZooKeeper session expired during " + what + "; a new one is being opened");
  }
}

// ----

// The fencing token of a node of ours: its czxid, the zxid of the transaction that created it.
// zxids grow strictly for the ensemble's life (the leader's epoch in the high 32 bits, a
// counter in the low ones), so a name's tokens keep growing when the server reaps its empty
// container parent and the sequence numbers restart (they did: 1, 2, 3, then 1 again after a
// minute idle). A created node's czxid is positive: as a std::uint64_t it is the same number.
// (A lease hold's nodes are made by one transaction: one czxid.)
std::uint64_t token_of(const Stat& stat) {
  if (stat.czxid <= 0) throw BackendUnavailable("ZooKeeper reported no creation zxid for a node of ours");
  return static_cast<std::uint64_t>(stat.czxid);
}

// What inspect shows of one node: its token, its creator (from its data) and its creation time.
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

// A writer's node whose data does not say it was downgraded blocks the readers behind it.
bool still_writing(const std::string& data) { return !parse_node_data(data).downgraded; }

class ZookeeperBackend;

class ZookeeperHold final : public BackendHold {
 public:
  ZookeeperHold(ZookeeperBackend& backend, std::shared_ptr<Session> session, std::vector<std::string> paths,
                std::uint64_t token, std::shared_ptr<LossSignal> loss);
  ~ZookeeperHold() override;

  std::uint64_t fencing_token() const override { return token_; }
  void downgrade() override;
  void release() override;

 private:
  ZookeeperBackend& backend_;
  std::shared_ptr<Session> session_;
  std::vector<std::string> paths_;  // our nodes: one entry, or one lease node per permit
  std::uint64_t token_;
  std::shared_ptr<LossSignal> loss_;
  std::shared_ptr<ServerLease> lease_;  // the session's, when the hold was made
  bool released_ = false;
  bool unconfirmed_release_ = false;  // a release attempt's outcome was unknown
};

// Storage for the core's queue loop: join makes our entry node and hands out its place (below);
// the storage calls here retry over connection losses and throw SessionGone.
class ZookeeperBackend final : public Backend {
 public:
  explicit ZookeeperBackend(Settings settings) : connection_(std::move(settings)) {}

  std::unique_ptr<QueuePlace> join(const QueueRequest& request, bool try_once, Deadline deadline,
                                   Standing& first) override;
  std::unique_ptr<CounterLine> counter_line(const std::string& name, std::int64_t permits,
                                            const std::stop_token& stop) override;
  Inspection inspect(const std::string& name, Deadline deadline) override;
  bool counter_try_set(const std::string& name, std::int64_t permits) override;
  std::int64_t counter_add(const std::string& name, std::int64_t delta) override;
  std::optional<std::int64_t> counter_get(const std::string& name) override;
  std::int64_t counter_drain(const std::string& name) override;

  Connection& connection() { return connection_; }
  const std::string& holder_label() const { return connection_.settings().holder_label; }
  std::shared_ptr<Session> session_for(Deadline deadline, const std::stop_token& stop = {}) {
    return connection_.session(deadline, stop);
  }
  // Under a chroot, the chroot's segments are the first ones of every name: the chroot "/app"
  // and the name "x" make the node of the name "app/x" (so "lock-0000000000" under "/app" is
  // app/%6Cock-0000000000, never an entry of the name "app").
  std::string path_of(const std::string& name) const {
    const auto& root = connection_.settings().root;
    return "/" + encode_name(root.empty() ? name : root.substr(root.front() == '/' ? 1 : 0) + "/" + name);
  }
  // The bound of a step's calls. A step must reach the server once whatever the deadline (a
  // join, the look that decides a try-once acquire): at least a short wait from now, so a
  // deadline that is near or past is a timeout judged on the server's answer, not trouble.
  // And never more than a call without a deadline waits (call_deadline), however far the
  // deadline: a step that gets no answer reports trouble rather than hang. `stop` ends it.
  CallBound call_bound(const Session& session, Deadline deadline, std::stop_token stop = {}) const {
    auto bound = SteadyClock::now() + session.short_wait();
    if (deadline) bound = std::max(bound, *deadline);
    return {std::min(bound, *call_deadline()), std::move(stop)};
  }

  // Creates every missing node of `path` (and `path` itself) as a container.
  void ensure_path(Session& session, const std::string& path, const CallBound& bound);
  // Creates an ephemeral sequential child PARENT/PREFIX<seq> and returns its name (not path);
  // with `token`, also its fencing token (token_of). After a connection loss it looks for its
  // own node by the protection prefix.
  std::string create_entry(Session& session, const std::string& parent, const std::string& prefix,
                           const std::string& uuid, const std::string& data, const CallBound& bound,
                           std::uint64_t* token = nullptr);
  // The fencing token of our node `path`, read from the server. When the server cannot tell
  // within the bound, `orphan` (the node, or what else a hold without a token leaves) goes to
  // the janitor and it throws; QueueEntryGone when the node is gone.
  std::uint64_t read_token(Session& session, const std::string& path, const CallBound& bound, const Orphan& orphan);
  // Reads, retried over connection losses.
  std::vector<std::string> list(Session& session, const std::string& path, bool watch, const CallBound& bound);
  std::optional<std::string> read(Session& session, const std::string& path, bool watch, const CallBound& bound,
                                  Stat* stat = nullptr);
  // Deletes a node of ours; when the connection is down, the janitor does it once it is back
  // (an entry we gave up on must never stay in line, CURATOR-678). Never blocks past one call.
  void remove_eventually(Session& session, const std::string& path) noexcept;
  // Whether a node of ours is gone, after a write whose reply was lost: read after a sync, so a
  // lagging ensemble member cannot answer from before the write. nullopt when the server did
  // not answer within the bound.
  std::optional<bool> gone(Session& session, const std::string& path, const CallBound& bound);
  // Sleeps until `path` changes, the deadline or a stop. At once when the node is already gone
  // or `still_blocks` says its data (read with the watch, so no change is missed) no longer does.
  void wait_for_change(Session& session, const std::string& path, Deadline deadline, const std::stop_token& stop,
                       bool (*still_blocks)(const std::string&) = nullptr);
  // Throws InvalidArgument when a lease request cannot be one ZooKeeper transaction.
  void check_lease_request(const QueueRequest& request, const std::string& lease_prefix, const std::string& lease_data);
  // One change of a PermitCounter's count (`ops`, to which it adds its marker): ZOK when
  // applied, kNotApplied (look again) or the server's refusal when not. When that is not known
  // within the bound: with `unresolved`, kOutcomeUnknown and the marker's path there (present:
  // applied) for the caller to resolve; without, the janitor removes the marker and it throws
  // BackendUnavailable.
  int change_count(Session& session, const std::string& count_path, std::vector<Session::Op> ops, const std::string& what,
                   const CallBound& bound, std::string* unresolved = nullptr);

 private:
  // After a failed call: true when another attempt is worth it (connection trouble, and the
  // connection back within the bound). Throws SessionGone when the session is gone.
  bool retry_after(Session& session, int rc, const CallBound& bound) {
    check_session(session, rc);
    if (!connection_trouble(rc) || bound.passed()) return false;
    // A short pause, then no call until the connection is back (a call made while it is down
    // waits inside the C client, past any deadline).
    std::this_thread::sleep_for(kRetryPause);
    return connection_.wait_connected(session, bound) && !bound.passed();
  }
  // For calls that have no deadline of their own (counters, inspect): a session timeout, at
  // least kMinCallWait.
  Deadline call_deadline() const {
    return SteadyClock::now() + std::max(kMinCallWait, connection_.settings().session_timeout);
  }
  std::optional<std::string> find_own(Session& session, const std::string& parent, const std::string& uuid,
                                      const CallBound& bound);
  void inspect_lock(Session& session, const std::string& path, const std::vector<std::string>& children,
                    Inspection& result, Deadline deadline);
  void inspect_semaphore(Session& session, const std::string& path, Inspection& result, Deadline deadline);

  Connection connection_;
  std::atomic<bool> containers_supported_{true};
  std::atomic<bool> create2_supported_{true};
};

ZookeeperHold::ZookeeperHold(ZookeeperBackend& backend, std::shared_ptr<Session> session, std::vector<std::string> paths,
                             std::uint64_t token, std::shared_ptr<LossSignal> loss)
    : backend_(backend), session_(std::move(session)), paths_(std::move(paths)), token_(token), loss_(std::move(loss)),
      lease_(session_->lease()) {
  lease_->attach(loss_);  // lost at once if the lease is
  // The session may outlive our nodes (deleted by hand or by a peer): watched, so that this
  // hold is told at once rather than never.
  backend_.connection().watch_held(*session_, paths_, loss_);
}

ZookeeperHold::~ZookeeperHold() {
  backend_.connection().unwatch_held(paths_);
  if (!released_) lease_->detach(loss_.get());  // the core releases first; this guards misuse
}

void ZookeeperHold::downgrade() {
  // The entry keeps its place and token: its data now says "shared", which turnstile readers
  // behind it read (their watch on it fires). Curator's readers still wait for it: safe.
  const int rc = session_->set(paths_.front(), node_data("downgraded", backend_.holder_label()), -1,
                               SteadyClock::now() + session_->short_wait());
  if (rc == ZOK) return;
  if (rc == ZNONODE || session_gone(rc)) {
    loss_->lose("its ZooKeeper session expired");
    return;
  }
  // Connection trouble: the set may or may not have been applied. Either way the entry is
  // consistent (a writer's or a downgraded one, same place, same token) and setting it again
  // is idempotent: the core retries, or releases the hold whole.
  throw_error("downgrade of '" + paths_.front() + "'", rc);
}

void ZookeeperHold::release() {
  if (released_) return;
  // Bounded, so unlock never waits for a silent link: an unanswered release is retried by the
  // core. Nothing is sent while the connection is known to be down.
  const Deadline bound = SteadyClock::now() + session_->short_wait();
  int rc = ZCONNECTIONLOSS;
  if (session_->expired()) {
    rc = ZSESSIONEXPIRED;
  } else if (session_->connected()) {
    // Our own deletion is no loss. (Not watched again if this attempt fails: the hold is being
    // given up, and the retry tells a node already gone apart.)
    backend_.connection().unwatch_held(paths_);
    // Leases go in one transaction, so a release never leaves some of them behind.
    std::vector<Session::Op> ops;
    for (const auto& path : paths_) ops.push_back(Session::Op::remove(path));
    rc = paths_.size() == 1 ? session_->remove(paths_.front(), bound) : session_->multi(ops, bound);
    if (connection_trouble(rc)) unconfirmed_release_ = true;
  }
  if (rc == ZNONODE && paths_.size() > 1) {
    // Some are gone already (an earlier attempt whose answer was lost): delete the rest.
    rc = ZOK;
    for (const auto& path : paths_) {
      const int one = session_->remove(path, bound);
      if (one != ZOK && one != ZNONODE) rc = one;
    }
  }
  if (rc == ZNONODE && unconfirmed_release_ && !session_->expired()) {
    // An earlier attempt's reply was lost: it did remove our nodes (nobody else deletes an
    // ephemeral node of a live session of ours).
    rc = ZOK;
  }
  if (connection_trouble(rc)) {
    if (session_->connected()) unconfirmed_release_ = true;
    // The core retries later (BackendUnavailable); the node stays ours meanwhile.
    throw_error("release of '" + paths_.front() + "'", rc);
  }
  released_ = true;
  lease_->detach(loss_.get());
  if (rc == ZOK) {
    if (session_->expired()) loss_->lose("its ZooKeeper session expired");
    return;
  }
  if (rc == ZNONODE || session_gone(rc)) {
    loss_->lose("its ZooKeeper session expired before the release");
    return;
  }
  throw_error("release of '" + paths_.front() + "'", rc);
}

void ZookeeperBackend::ensure_path(Session& session, const std::string& path, const CallBound& bound) {
  // Top down: each level exists or is created; a container left empty is reaped by the server.
  for (std::size_t slash = path.find('/', 1);; slash = path.find('/', slash + 1)) {
    const auto prefix = slash == std::string::npos ? path : path.substr(0, slash);
    for (;;) {
      const int flags = containers_supported_ ? ZOO_CONTAINER : ZOO_PERSISTENT;
      const int rc = session.create(prefix, "", flags, bound);
      if (rc == ZOK || rc == ZNODEEXISTS) break;
      if (rc == ZUNIMPLEMENTED && containers_supported_) {
        containers_supported_ = false;  // a server before 3.5: persistent parents, as Curator does
        continue;
      }
      if (!retry_after(session, rc, bound)) give_up(bound, "create of '" + prefix + "'", rc);
    }
    if (slash == std::string::npos) break;
  }
}

std::string ZookeeperBackend::create_entry(Session& session, const std::string& parent, const std::string& prefix,
                                           const std::string& uuid, const std::string& data, const CallBound& bound,
                                           std::uint64_t* token) {
  const auto path = parent + "/" + prefix;
  for (;;) {
    std::string created;
    Stat stat{};
    // The token comes with the create's answer (create2), or is read after it.
    const bool with_stat = token && create2_supported_;
    const int rc = session.create(path, data, ZOO_EPHEMERAL_SEQUENTIAL, bound, &created, with_stat ? &stat : nullptr);
    if (rc == ZUNIMPLEMENTED && with_stat) {
      create2_supported_ = false;  // a server before 3.5
      continue;
    }
    if (rc == ZOK) {
      auto node = created.substr(parent.size() + 1);
      if (token) {
        *token = with_stat ? token_of(stat) : read_token(session, created, bound, {session.weak_from_this(), created, "", ""});
      }
      return node;
    }
    if (rc == ZNONODE) {
      ensure_path(session, parent, bound);  // first use, or the server reaped the empty container
      continue;
    }
    check_session(session, rc);
    if (!connection_trouble(rc)) throw_error("create under '" + parent + "'", rc);
    if (auto mine = find_own(session, parent, uuid, bound)) {
      const auto own = parent + "/" + *mine;
      if (token) *token = read_token(session, own, bound, {session.weak_from_this(), own, "", ""});
      return *mine;
    }
    // Not made: create it again (same protection id, so a second loss is resolved alike).
  }
}

std::uint64_t ZookeeperBackend::read_token(Session& session, const std::string& path, const CallBound& bound,
                                           const Orphan& orphan) {
  for (;;) {
    Stat stat{};
    const int rc = bound.passed() ? ZOPERATIONTIMEOUT : session.exists(path, false, bound, &stat);
    if (rc == ZOK) return token_of(stat);
    if (rc == ZNONODE) throw QueueEntryGone{};
    if (!retry_after(session, rc, bound)) {
      connection_.remove_later(orphan);  // a node of ours without its token holds for nobody
      if (bound.stopped()) throw CallStopped{};
      unconfirmed("the fencing token of '" + path + "' (" + zerror(rc) + ")",
                  "its nodes are removed once the connection is back");
    }
  }
}

// After a create whose reply was lost: our node, if the server made it, found by the protection
// id; nullopt when it was not made. When that stays unknown past the bound (or its stop), hands
// the look-up to the janitor (which removes the node) and throws BackendUnavailable (CallStopped).
std::optional<std::string> ZookeeperBackend::find_own(Session& session, const std::string& parent, const std::string& uuid,
                                                      const CallBound& bound) {
  for (;;) {
    std::vector<std::string> mine;
    // Past the bound (the create itself waited that long): the janitor's job, not the caller's.
    const int rc = bound.passed()        ? ZOPERATIONTIMEOUT
                   : session.connected() ? own_children(session, parent, uuid, bound, &mine)
                                         : ZCONNECTIONLOSS;
    if (rc == ZOK) return mine.empty() ? std::nullopt : std::optional(mine.front());
    if (!retry_after(session, rc, bound)) {
      // Still unknown: the janitor finds and removes it once the connection is back, so it
      // never waits in line (or holds) for nobody.
      connection_.remove_later({session.weak_from_this(), "", parent, uuid});
      if (bound.stopped()) throw CallStopped{};
      unconfirmed("a create under '" + parent + "' (" + zerror(rc) + ")",
                  "its node, if it was made, is removed once the connection is back");
    }
  }
}

std::vector<std::string> ZookeeperBackend::list(Session& session, const std::string& path, bool watch,
                                                const CallBound& bound) {
  for (;;) {
    std::vector<std::string> children;
    const int rc = session.children(path, watch, bound, &children);
    if (rc == ZOK) return children;
    if (rc == ZNONODE) return {};
    if (!retry_after(session, rc, bound)) give_up(bound, "listing of '" + path + "'", rc);
  }
}

std::optional<std::string> ZookeeperBackend::read(Session& session, const std::string& path, bool watch,
                                                  const CallBound& bound, Stat* stat) {
  for (;;) {
    std::string data;
    const int rc = session.get(path, watch, bound, &data, stat);
    if (rc == ZOK) return data;
    if (rc == ZNONODE) return std::nullopt;
    if (!retry_after(session, rc, bound)) give_up(bound, "read of '" + path + "'", rc);
  }
}

void ZookeeperBackend::remove_eventually(Session& session, const std::string& path) noexcept {
  // On a link that just left a call unanswered, the delete is sent but not waited for: the
  // janitor confirms it (its own delete finds the node gone, or removes it).
  const auto bound = SteadyClock::now() + (session.silent() ? milliseconds(0) : session.short_wait());
  const int rc = session.remove(path, bound);
  if (!connection_trouble(rc)) return;  // removed, or gone with its session
  try {
    connection_.remove_later({session.weak_from_this(), path, "", ""});
  } catch (...) {
    // Out of memory: the node goes with the session.
  }
}

std::optional<bool> ZookeeperBackend::gone(Session& session, const std::string& path, const CallBound& bound) {
  for (;;) {
    if (bound.passed()) return std::nullopt;  // the janitor's job now
    int rc = session.sync(path.substr(0, path.rfind('/')), bound);
    if (rc == ZOK) rc = session.exists(path, false, bound);
    if (rc == ZOK) return false;
    if (rc == ZNONODE) return true;
    if (!retry_after(session, rc, bound)) return std::nullopt;
  }
}

void ZookeeperBackend::wait_for_change(Session& session, const std::string& path, Deadline deadline,
                                       const std::stop_token& stop, bool (*still_blocks)(const std::string&)) {
  PathWatch watch(connection_, path);
  // getData, not exists: a node already gone leaves no watch behind. The read that sets the
  // watch is the one that decides: a change between the look and the watch is not missed.
  const auto data = read(session, path, true, call_bound(session, deadline, stop));
  if (!data || (still_blocks && !still_blocks(*data))) return;
  watch.sleep(deadline, stop);
  check_session(session, ZOK);
}

// One lease node per permit, all made in one multi (Curator's layout): the request must fit
// ZooKeeper's request limit (jute.maxbuffer, 1 MB by default) or the server refuses it every
// time. We allow at most kMaxZookeeperPermits per acquire, and a transaction of at most half
// that limit (long names and chroots make each node's path longer).
constexpr std::int64_t kMaxZookeeperPermits = 1000;
constexpr std::size_t kMaxTransactionBytes = 512 * 1024;

void ZookeeperBackend::check_lease_request(const QueueRequest& request, const std::string& lease_prefix,
                                           const std::string& lease_data) {
  if (request.permits > kMaxZookeeperPermits) {
    throw InvalidArgument("Semaphore '" + request.name + "': " + std::to_string(request.permits) +
                          " permits in one acquire; ZooKeeper takes at most " + std::to_string(kMaxZookeeperPermits) +
                          " (one node per permit, made in one transaction)");
  }
  // Per create: header and lengths (~40 bytes), the path with its sequence suffix, the data,
  // the ACL (scheme, id and perms; the digest id is the user plus a 28-byte hash).
  const std::size_t acl = 40 + connection_.settings().user.size() + 32;
  const std::size_t per_lease = 40 + lease_prefix.size() + kSequenceDigits + lease_data.size() + acl;
  const std::size_t bytes = per_lease * static_cast<std::size_t>(std::max<std::int64_t>(request.permits, 1)) + 1024;
  if (bytes > kMaxTransactionBytes) {
    throw InvalidArgument("Semaphore '" + request.name + "': " + std::to_string(request.permits) +
                          " permits make a ZooKeeper transaction of about " + std::to_string(bytes / 1024) +
                          " KiB with this name; at most " + std::to_string(kMaxTransactionBytes / 1024) + " KiB");
  }
}

// ---- The queues: our entry node, from join until it becomes a hold or leaves ----

class EntryPlace : public QueuePlace {
 public:
  // Makes our node (ephemeral sequential, named PARENT/_c_<uuid>-<label><seq>).
  void enter(Deadline deadline) {
    node_ = backend_.create_entry(*session_, parent_, "_c_" + uuid_ + "-" + label_, uuid_, data_,
                                  backend_.call_bound(*session_, deadline), &token_);
  }
  // A look's calls give up a session timeout after the connection went down; the waiter waits
  // on through the outage (a leader election, a restart) until its own deadline or stop, as
  // Curator's recipes do: the session reconnects and the look answers, or the session expired
  // and our entry with it (QueueEntryGone: the core joins again).
  template <class Look>
  Standing through_outages(Deadline deadline, Look&& look) {
    for (;;) {
      try {
        return look();
      } catch (const ConnectionGaveUp&) {
        // A stop is presented as our entry gone, as queue_step does: the core gives up and leaves.
        if (request_.stop.stop_requested()) throw QueueEntryGone{};
        if (deadline && SteadyClock::now() >= *deadline) throw;
        if (!backend_.connection().wait_connected(*session_, CallBound(deadline, request_.stop))) {
          if (request_.stop.stop_requested()) throw QueueEntryGone{};
          throw;
        }
      }
    }
  }
  // Waits for the entry the verdict names, by its node: its deletion, or (exclusive_end) also
  // its downgrade.
  void wait(const Verdict& verdict, Deadline deadline, const std::stop_token& stop) override {
    const auto target = parent_ + "/" + nodes_.at(verdict.index);
    // A long queue's listing is not kept while we sleep: memory per waiter stays constant (the
    // next look lists again).
    std::vector<std::string>().swap(nodes_);
    queue_step([&] {
      backend_.wait_for_change(*session_, target, deadline, stop,
                               verdict.wait == WaitFor::exclusive_end ? still_writing : nullptr);
    });
  }
  void leave() noexcept override {
    if (left_ || node_.empty()) return;
    left_ = true;
    backend_.remove_eventually(*session_, parent_ + "/" + node_);
  }

 protected:
  EntryPlace(ZookeeperBackend& backend, std::shared_ptr<Session> session, const QueueRequest& request,
             std::string parent, const char* label, std::string data)
      : backend_(backend), session_(std::move(session)), request_(request), path_(backend.path_of(request.name)),
        parent_(std::move(parent)), label_(label), data_(std::move(data)) {}

  // Of our parent's `children`, the live entries up to ours, in queue order.
  std::vector<EntryNode> entries_up_to_ours(const std::vector<std::string>& children) const {
    auto entries = sorted_entries(children);
    const auto me = index_of(entries, node_);
    if (me == entries.size()) throw QueueEntryGone{};  // our ephemeral node is gone
    entries.resize(me + 1);
    return entries;
  }
  void remember(const std::vector<EntryNode>& entries) {
    nodes_.clear();
    for (const auto& entry : entries) nodes_.push_back(entry.node);
  }

  ZookeeperBackend& backend_;
  std::shared_ptr<Session> session_;
  QueueRequest request_;
  std::string path_;    // the name's node
  std::string parent_;  // our node's parent: the name's node, or a semaphore's line
  const char* label_;
  std::string data_;
  std::string uuid_ = random_uuid();
  std::string node_;                // ours
  std::uint64_t token_ = 0;         // its fencing token (a lock's hold keeps it)
  std::vector<std::string> nodes_;  // the last look's entries up to ours
  bool left_ = false;
};

// Mutex, RecursiveMutex, SharedMutex: Curator's lock nodes, children of the name's node.
class LockPlace final : public EntryPlace {
 public:
  LockPlace(ZookeeperBackend& backend, std::shared_ptr<Session> session, const QueueRequest& request)
      : EntryPlace(backend, session, request, backend.path_of(request.name), label_of(request),
                   node_data(request.kind == EntryKind::shared ? "shared" : "exclusive", backend.holder_label())) {}

  Standing look(Deadline deadline) override {
    return through_outages(deadline, [&] { return look_once(deadline); });
  }
  Standing look_once(Deadline deadline) {
    return queue_step([&] {
      const auto bound = backend_.call_bound(*session_, deadline);
      const auto children = backend_.list(*session_, path_, false, bound);
      auto entries = entries_up_to_ours(children);
      if (request_.kind == EntryKind::shared) present_downgrades(entries, bound);
      Standing standing;
      standing.mode = entries.size() > 1 ? QueueMode::lock : QueueMode::none;
      // A semaphore on the same name is a kind mismatch (we joined first, then looked: of two
      // racing contenders at least one sees the other).
      if (semaphore_in_use(children, bound)) standing.mode = QueueMode::semaphore;
      for (const auto& entry : entries) standing.entries.push_back({entry.kind, 1});
      remember(entries);
      return standing;
    });
  }
  std::unique_ptr<BackendHold> hold(std::shared_ptr<LossSignal> loss) override {
    return std::make_unique<ZookeeperHold>(backend_, session_, std::vector<std::string>{path_ + "/" + node_}, token_,
                                           std::move(loss));
  }

 private:
  // A SharedMutex's nodes are named as Curator's InterProcessReadWriteLock names them, a
  // Mutex's as InterProcessMutex's.
  static const char* label_of(const QueueRequest& request) {
    if (request.kind == EntryKind::shared) return kReadLabel;
    return request.primitive == Primitive::shared_mutex ? kWriteLabel : kMutexLabel;
  }
  // A reader waits for the nearest writer ahead that has not downgraded (its node's data says
  // so): the writers ahead are read, nearest first, until one still writes. Downgraded ones are
  // presented as shared, ones gone meanwhile not at all; those further ahead as their names say
  // (the predicate looks no further than the first writer).
  void present_downgrades(std::vector<EntryNode>& entries, const CallBound& bound) {
    for (std::size_t i = entries.size() - 1; i-- > 0;) {
      if (entries[i].kind != EntryKind::exclusive) continue;
      const auto data = backend_.read(*session_, path_ + "/" + entries[i].node, false, bound);
      if (!data) {
        entries.erase(entries.begin() + static_cast<std::ptrdiff_t>(i));
      } else if (still_writing(*data)) {
        return;
      } else {
        entries[i].kind = EntryKind::shared;
      }
    }
  }
  bool semaphore_in_use(const std::vector<std::string>& children, const CallBound& bound) {
    for (const auto& child : children) {
      if (child != "locks" && child != "leases") continue;
      Stat stat{};
      const int rc = session_->exists(path_ + "/" + child, false, bound, &stat);
      check_session(*session_, rc);
      if (rc == ZOK && stat.numChildren > 0) return true;
    }
    return false;
  }
};

// Semaphore: InterProcessSemaphoreV2's layout. The line `locks` is a mutex whose head alone may
// add leases (one node of `leases` per permit), so the transaction that adds ours and leaves the
// line is atomic with the count it was decided on. Presented to the core in two stages: in line,
// the line up to ours as exclusive entries (wait for the one just ahead to leave); at its head,
// the held leases (one permit each) followed by ours, under the limit.
class LeasePlace final : public EntryPlace {
 public:
  LeasePlace(ZookeeperBackend& backend, std::shared_ptr<Session> session, const QueueRequest& request, bool try_once)
      : EntryPlace(backend, session, request, backend.path_of(request.name) + "/locks", kMutexLabel,
                   node_data("lease", backend.holder_label(), request.permits)),
        leases_(path_ + "/leases"), lease_prefix_(leases_ + "/_c_" + uuid_ + "-" + kLeaseLabel), try_once_(try_once) {
    backend.check_lease_request(request, lease_prefix_, data_);
  }

  Standing look(Deadline deadline) override {
    return through_outages(deadline, [&] { return look_once(deadline); });
  }
  Standing look_once(Deadline deadline) {
    return queue_step([&] {
      deadline_ = deadline;
      const auto bound = backend_.call_bound(*session_, deadline);
      // A lock on the same name is a kind mismatch (joined first, then looked).
      const bool lock_in_use = !lock_checked_ && !sorted_entries(backend_.list(*session_, path_, false, bound)).empty();
      lock_checked_ = true;
      const auto line = entries_up_to_ours(backend_.list(*session_, parent_, false, bound));
      remember(line);
      auto standing = line.size() > 1 ? look_in_line(line.size(), bound) : look_at_head(bound);
      if (lock_in_use) standing.mode = QueueMode::lock;
      return standing;
    });
  }
  void wait(const Verdict& verdict, Deadline deadline, const std::stop_token& stop) override {
    if (verdict.wait != WaitFor::any_holder_leave) return EntryPlace::wait(verdict, deadline, stop);
    std::vector<std::string>().swap(nodes_);  // not kept while we sleep (see EntryPlace::wait)
    queue_step([&] {
      if (leases_watch_) leases_watch_->sleep(deadline, stop);
      leases_watch_.reset();
      check_session(*session_, ZOK);
    });
  }
  std::unique_ptr<BackendHold> hold(std::shared_ptr<LossSignal> loss) override {
    return queue_step([&] {
      leases_watch_.reset();
      auto& session = *session_;
      const auto bound = backend_.call_bound(session, deadline_);
      std::vector<std::string> created;
      const int rc = session.multi(admission(), bound, &created);
      if (rc == ZOK) return make_hold(std::move(created), bound, loss);
      if (rc == ZBADVERSION) throw QueueChanged{};  // someone else recorded a limit meanwhile
      if (rc == ZNONODE) {
        backend_.ensure_path(session, leases_, bound);  // the empty container was reaped
        throw QueueChanged{};
      }
      check_session(session, rc);
      if (!connection_trouble(rc)) throw_error("lease of '" + path_ + "'", rc);
      return hold_after_lost_reply(bound, loss);
    });
  }

 private:
  Standing look_in_line(std::size_t entries, const CallBound& bound) {
    Standing standing;
    standing.entries.assign(entries, {EntryKind::exclusive, 1});
    if (!limit_checked_) {
      // Queued behind others: a disagreeing limit is refused now rather than after the wait.
      limit_checked_ = true;
      const auto data = backend_.read(*session_, path_, false, bound);
      const auto limit = data ? recorded_limit(*data) : std::nullopt;
      if (limit && *limit != request_.limit && !backend_.list(*session_, leases_, false, bound).empty()) {
        standing.mode = QueueMode::semaphore;
        standing.limit = *limit;
      }
    }
    return standing;
  }
  Standing look_at_head(const CallBound& bound) {
    Stat stat{};
    const auto data = backend_.read(*session_, path_, false, bound, &stat);
    if (!data) throw QueueEntryGone{};  // the parent of our line cannot be gone while we live
    recorded_ = recorded_limit(*data);
    version_ = stat.version;
    leases_watch_.reset();
    if (!try_once_) leases_watch_.emplace(backend_.connection(), leases_);  // before the read that sets it
    const auto held = static_cast<std::int64_t>(sorted_entries(backend_.list(*session_, leases_, !try_once_, bound)).size());
    Standing standing;
    if (held > 0 && recorded_) {
      standing.mode = QueueMode::semaphore;
      standing.limit = *recorded_;
    }
    // More leases held than our limit allows: someone with a larger limit took them (Curator's
    // InterProcessSemaphoreV2 records no limit and checks none). Contenders that agree with us
    // cannot get here: only the head of the line adds leases, within its limit (turnstile: in
    // the transaction that leaves the line; Curator: its lease node exists before its count
    // check only while it heads the line), and we are the head now. Waiting would starve us
    // silently behind a disagreement, so refuse it as a recorded one is refused. (One blind
    // spot: a Curator contender that timed out during a connection loss retries the deletes of
    // its lease and of its line node in the background, in either order.)
    if (held > request_.limit) {
      throw LimitMismatch("Semaphore '" + request_.name + "' has " + std::to_string(held) +
                          " leases held, more than this contender's limit " + std::to_string(request_.limit) +
                          ": another contender (e.g. Curator's InterProcessSemaphoreV2) uses a larger limit");
    }
    standing.entries.assign(static_cast<std::size_t>(held), {EntryKind::lease, 1});
    standing.entries.push_back({EntryKind::lease, request_.permits});
    return standing;
  }
  // One transaction: record the limit (if it changes), add our leases, leave the line. Nothing
  // half-done can leak (CURATOR-315 and kin).
  std::vector<Session::Op> admission() const {
    std::vector<Session::Op> ops;
    ops.reserve(static_cast<std::size_t>(request_.permits) + 2);
    if (recorded_ != request_.limit) {
      ops.push_back(Session::Op::set(path_, "limit=" + std::to_string(request_.limit), version_));
    }
    for (std::int64_t i = 0; i < request_.permits; ++i) {
      ops.push_back(Session::Op::create(lease_prefix_, data_, ZOO_EPHEMERAL_SEQUENTIAL));
    }
    ops.push_back(Session::Op::remove(parent_ + "/" + node_));
    return ops;
  }
  // The admission's reply was lost: it was applied iff our place in line is gone (and our
  // leases exist). "Gone" only on the server's word (after a sync), never on a failed look.
  std::unique_ptr<BackendHold> hold_after_lost_reply(const CallBound& bound, std::shared_ptr<LossSignal>& loss) {
    auto& session = *session_;
    // Whatever it made of ours is removed once the connection is back (the line node by
    // leave()), never left to hold for nobody.
    const auto orphan_leases = [&] { backend_.connection().remove_later({session.weak_from_this(), "", leases_, uuid_}); };
    const auto applied = backend_.gone(session, parent_ + "/" + node_, bound);
    if (!applied) {
      orphan_leases();
      unconfirmed("the leases of '" + request_.name + "'", "any it made are removed once the connection is back");
    }
    if (!*applied) throw QueueChanged{};  // still heading the line
    std::vector<std::string> paths;
    try {
      for (const auto& lease : sorted_entries(backend_.list(session, leases_, false, bound))) {
        if (lease.uuid == uuid_) paths.push_back(leases_ + "/" + lease.node);
      }
    } catch (const BackendUnavailable&) {
      orphan_leases();
      throw;
    }
    if (paths.empty()) throw QueueEntryGone{};  // our line node was removed under us
    return make_hold(std::move(paths), bound, loss);
  }
  // Our lease nodes become the hold, with the token of the transaction that made them all (one
  // more call: a multi's answer carries no Stat).
  std::unique_ptr<BackendHold> make_hold(std::vector<std::string> paths, const CallBound& bound,
                                         std::shared_ptr<LossSignal>& loss) {
    left_ = true;  // the transaction left the line
    const Orphan leases{session_->weak_from_this(), "", leases_, uuid_};
    std::uint64_t token = 0;
    try {
      token = backend_.read_token(*session_, paths.front(), bound, leases);
    } catch (const QueueEntryGone&) {
      backend_.connection().remove_later(leases);  // one was removed under us: the others go too
      throw;
    }
    return std::make_unique<ZookeeperHold>(backend_, session_, std::move(paths), token, std::move(loss));
  }

  std::string leases_;
  std::string lease_prefix_;
  bool try_once_;
  Deadline deadline_;                    // the last look's: the admission's calls are bounded by it
  std::optional<std::int64_t> recorded_; // the limit recorded when we last looked from the head
  int version_ = -1;                     // of the name's node then
  std::optional<PathWatch> leases_watch_;
  bool lock_checked_ = false;
  bool limit_checked_ = false;
};

std::unique_ptr<QueuePlace> ZookeeperBackend::join(const QueueRequest& request, bool try_once, Deadline deadline,
                                                   Standing& first) {
  return queue_step([&] {
    auto session = session_for(deadline);  // a live one: the last one's expiry may be why we join again
    std::unique_ptr<EntryPlace> place;
    if (request.kind == EntryKind::lease) place = std::make_unique<LeasePlace>(*this, std::move(session), request, try_once);
    else place = std::make_unique<LockPlace>(*this, std::move(session), request);
    place->enter(deadline);
    try {
      first = place->look(deadline);
    } catch (...) {
      place->leave();
      throw;
    }
    return std::unique_ptr<QueuePlace>(std::move(place));
  });
}

// ---- PermitCounter ----
//
// The count is the text of ROOT/NAME/permits, changed only by a transaction that names the
// version it read (compare-and-set) and makes a marker node of its own (change_count), so a
// change whose reply was lost is known to have happened or not. Waiters line up as ephemeral
// sequential nodes in ROOT/NAME/permit-waiters; the head watches the count, the others their
// predecessor.

// The answer of change_count when a change whose reply was lost turned out not applied: the
// caller looks again, as after losing a race.
constexpr int kNotApplied = ZBADVERSION;
// The answer of change_count when the outcome stayed unknown and the caller resolves it.
constexpr int kOutcomeUnknown = ZOPERATIONTIMEOUT;

// One PermitCounter acquire: outside the line, then (once it has to wait) with a node in it.
// Every call ends on the caller's stop (the core then gives up and leaves).
class PermitLine final : public CounterLine {
 public:
  PermitLine(ZookeeperBackend& backend, const std::string& name, std::int64_t permits, std::stop_token stop)
      : backend_(backend), name_(name), permits_(permits), count_path_(backend.path_of(name) + "/permits"),
        line_(backend.path_of(name) + "/permit-waiters"), stop_(std::move(stop)) {}

  CounterStanding look(bool last_try, Deadline deadline) override {
    return queue_step([&] {
      auto& session = this->session(deadline);
      const auto bound = backend_.call_bound(session, deadline, stop_);
      CounterStanding standing;
      standing.in_line = !node_.empty();
      const auto line = sorted_entries(backend_.list(session, line_, false, bound));
      standing.ahead = standing.in_line ? index_of(line, node_) : line.size();
      if (standing.in_line && standing.ahead == line.size()) throw QueueEntryGone{};
      if (standing.ahead > 0) {
        predecessor_ = line[standing.ahead - 1].node;  // the count does not matter yet
        return standing;
      }
      read_count(standing.in_line && !last_try, bound);
      if (has_count_) standing.value = saturated(count_.value);
      return standing;
    });
  }
  bool take(const CounterStanding&, Deadline deadline) override {
    return queue_step([&] {
      if (stop_.stop_requested()) throw CallStopped{};  // nothing sent: nothing to find out
      auto& session = this->session(deadline);
      const auto bound = backend_.call_bound(session, deadline, stop_);
      require_exact(count_, name_);
      const auto what = "PermitCounter::acquire(" + std::to_string(permits_) + ") of '" + name_ + "'";
      const auto left = Session::Op::set(count_path_, count_text(count_.value - permits_), version_);
      if (node_.empty()) {
        std::string marker;
        const int rc = backend_.change_count(session, count_path_, {left}, what, bound, &marker);
        if (rc == ZOK) return true;
        if (rc == kNotApplied || rc == ZNONODE) return false;
        if (rc == kOutcomeUnknown) {
          unconfirmed_take_ = {marker, false};  // leave() may still find out
          unconfirmed(what, "it may or may not have been applied");
        }
        throw_error("update of '" + count_path_ + "'", rc);
      }
      // Take them and leave the line in one transaction.
      const int rc = session.multi({left, Session::Op::remove(line_ + "/" + node_)}, bound);
      if (rc == ZOK || rc == ZBADVERSION) {
        if (rc == ZOK) node_.clear();
        return rc == ZOK;
      }
      check_session(session, rc);
      if (!connection_trouble(rc)) throw_error("update of '" + count_path_ + "'", rc);
      // Unknown outcome: applied iff our place in line is gone, on the server's word after a
      // sync (never resent: it could take the permits twice).
      const auto applied = backend_.gone(session, line_ + "/" + node_, bound);
      if (!applied) {
        unconfirmed_take_ = {line_ + "/" + node_, true};  // leave() may still find out
        unconfirmed(what, "it may or may not have been applied");
      }
      if (*applied) node_.clear();
      return *applied;
    });
  }
  void join(Deadline deadline) override {
    queue_step([&] {
      auto& session = this->session(deadline);
      const auto uuid = random_uuid();
      node_ = backend_.create_entry(session, line_, "_c_" + uuid + "-" + kWaitLabel, uuid,
                                    node_data("permits", backend_.holder_label(), permits_),
                                    backend_.call_bound(session, deadline, stop_));
    });
  }
  void wait(CounterWait wait, Deadline deadline, const std::stop_token& stop) override {
    queue_step([&] {
      if (wait == CounterWait::predecessor) {
        backend_.wait_for_change(*session_, line_ + "/" + predecessor_, deadline, stop);
      } else if (count_watch_) {
        count_watch_->sleep(deadline, stop);
        check_session(*session_, ZOK);
      }
      count_watch_.reset();
    });
  }
  bool leave() noexcept override {
    const bool taken = unconfirmed_take_ && resolve_take();
    if (!node_.empty()) backend_.remove_eventually(*session_, line_ + "/" + node_);
    node_.clear();
    return taken;
  }

 private:
  // A take whose reply was lost and whose outcome was still unknown when it gave up (its
  // deadline passed, or its stop came, before the session was back): whether it was applied,
  // on the server's word after one short wait for the connection and one for a read after a
  // sync (bounded: never the caller's stop, which may be what ended the take). Its evidence is
  // our node in line (the take removed it) or the take's marker (the take made it); the take
  // was sent on the old connection, so it cannot be applied after that read. False when still
  // unknown (the session expired, taking the evidence with it, or no answer in time): the
  // marker goes to the janitor.
  bool resolve_take() noexcept {
    const auto take = std::exchange(unconfirmed_take_, std::nullopt);
    auto& session = *session_;
    std::optional<bool> absent;
    try {
      if (backend_.connection().wait_connected(session, SteadyClock::now() + session.short_wait())) {
        absent = backend_.gone(session, take->path, SteadyClock::now() + session.short_wait());
      }
    } catch (...) {  // the session expired
    }
    const bool applied = absent && *absent == take->applied_if_gone;
    if (take->applied_if_gone) {
      if (applied) node_.clear();  // the take removed it
    } else if (!absent) {
      backend_.connection().remove_later({session.weak_from_this(), take->path, "", ""});
    } else if (applied) {
      backend_.remove_eventually(session, take->path);
    }
    return applied;
  }
  Session& session(Deadline deadline) {
    if (!session_) session_ = backend_.session_for(deadline, stop_);
    return *session_;
  }
  // Reads the count (and its version) for the head of the line; `watch`: and watches it, or its
  // creation, for the wait.
  void read_count(bool watch, const CallBound& bound) {
    count_watch_.reset();
    if (watch) count_watch_.emplace(backend_.connection(), count_path_);
    for (;;) {
      Stat stat{};
      const auto text = backend_.read(*session_, count_path_, watch, bound, &stat);
      has_count_ = text.has_value();
      count_ = text ? count_of(*text, name_) : Count{};
      version_ = stat.version;
      if (text || !watch) return;
      const int rc = session_->exists(count_path_, true, bound);  // a watch for its creation
      check_session(*session_, rc);
      if (rc != ZOK) return;  // still missing (or no answer: the session's events still wake us)
    }
  }

  ZookeeperBackend& backend_;
  std::string name_;
  std::int64_t permits_;
  std::string count_path_;
  std::string line_;
  std::shared_ptr<Session> session_;  // the live one at the first call
  std::string node_;                  // ours in line, "" outside it
  std::string predecessor_;           // the last look's waiter just ahead
  bool has_count_ = false;            // the last look's count, as read from the head
  Count count_;
  int version_ = -1;
  std::optional<PathWatch> count_watch_;
  std::stop_token stop_;  // the caller's
  struct UnconfirmedTake {
    std::string path;      // the node whose presence tells
    bool applied_if_gone;  // our node in line; else the take's marker (applied if present)
  };
  std::optional<UnconfirmedTake> unconfirmed_take_;
};

std::unique_ptr<CounterLine> ZookeeperBackend::counter_line(const std::string& name, std::int64_t permits,
                                                            const std::stop_token& stop) {
  return std::make_unique<PermitLine>(*this, name, permits, stop);
}

int ZookeeperBackend::change_count(Session& session, const std::string& count_path, std::vector<Session::Op> ops,
                                   const std::string& what, const CallBound& bound, std::string* unresolved) {
  // The marker: an ephemeral child of the count's node, made by the same transaction, so that
  // after a lost reply its presence (read after a sync) says whether the change was applied.
  // Nobody else makes it (its name is random) and no name reaches it (a `permits` segment is
  // encoded). A value and version read back would not do: a peer that read the same version
  // may have written the same text.
  const auto marker = count_path + "/_c_" + random_uuid() + "-change";
  ops.push_back(Session::Op::create(marker, "", ZOO_EPHEMERAL));
  const int rc = session.multi(ops, bound);
  if (rc == ZOK) {
    remove_eventually(session, marker);
    return ZOK;
  }
  check_session(session, rc);
  if (!connection_trouble(rc)) return rc;
  // Unknown outcome. Resent never (it could apply twice): decided by the marker, on the
  // server's word after a sync; the transaction cannot still be applied after that (a
  // session's requests are applied in order, and the old connection's are done before the
  // new one is served).
  const auto absent = gone(session, marker, bound);
  if (!absent && unresolved) {
    *unresolved = marker;  // not for the janitor yet: its removal would read as "not applied"
    return kOutcomeUnknown;
  }
  if (!absent) {
    connection_.remove_later({session.weak_from_this(), marker, "", ""});
    unconfirmed(what, "it may or may not have been applied");
  }
  if (*absent) return kNotApplied;
  remove_eventually(session, marker);
  return ZOK;
}

bool ZookeeperBackend::counter_try_set(const std::string& name, std::int64_t permits) {
  const auto deadline = call_deadline();
  auto session = session_for(deadline);
  const auto path = path_of(name) + "/permits";
  const auto what = "PermitCounter::try_set_permits(" + std::to_string(permits) + ") of '" + name + "'";
  return outside_queue("PermitCounter::try_set_permits (the change may or may not have been applied)", [&] {
    for (;;) {
      const int rc = change_count(*session, path, {Session::Op::create(path, std::to_string(permits), ZOO_PERSISTENT)},
                                  what, deadline);
      if (rc == ZOK) return true;
      if (rc == ZNODEEXISTS) return false;
      if (rc == ZNONODE) ensure_path(*session, path_of(name), deadline);
      else if (rc != kNotApplied) throw_error("create of '" + path + "'", rc);
    }
  });
}

std::int64_t ZookeeperBackend::counter_add(const std::string& name, std::int64_t delta) {
  const auto deadline = call_deadline();
  auto session = session_for(deadline);
  const auto path = path_of(name) + "/permits";
  const auto what = "PermitCounter::add_permits(" + std::to_string(delta) + ") of '" + name + "'";
  return outside_queue("PermitCounter::add_permits (the change may or may not have been applied)", [&] {
    for (;;) {
      Stat stat{};
      const auto text = read(*session, path, false, deadline, &stat);
      const Count count = text ? count_of(*text, name) : Count{};
      require_exact(count, name);
      const __int128 sum = count.value + delta;  // no overflow: |value| < 10^38, |delta| <= 10^12
      // A change may not take the count further beyond +-max_permits; one that moves it back
      // toward that range is always allowed, so a count a peer pushed beyond it never wedges.
      if ((delta > 0 && sum > max_permits) || (delta < 0 && sum < -max_permits)) {
        throw InvalidArgument("PermitCounter '" + name + "': adding " + std::to_string(delta) + " to " +
                              count_text(count.value) + " would take it beyond +-" + std::to_string(max_permits) +
                              "; nothing changed");
      }
      const auto op = text ? Session::Op::set(path, count_text(sum), stat.version)
                           : Session::Op::create(path, count_text(sum), ZOO_PERSISTENT);
      const int rc = change_count(*session, path, {op}, what, deadline);
      if (rc == ZOK) return saturated(sum);
      if (rc == ZNONODE && !text) ensure_path(*session, path_of(name), deadline);
      else if (rc != kNotApplied && rc != ZNODEEXISTS && rc != ZNONODE) throw_error("update of '" + path + "'", rc);
    }
  });
}

std::optional<std::int64_t> ZookeeperBackend::counter_get(const std::string& name) {
  const auto deadline = call_deadline();
  return outside_queue("PermitCounter::available_permits", [&]() -> std::optional<std::int64_t> {
    for (;;) {
      auto session = session_for(deadline);
      try {
        const auto text = read(*session, path_of(name) + "/permits", false, deadline);
        if (!text) return std::nullopt;
        return saturated(count_of(*text, name).value);
      } catch (const SessionGone&) {
        if (past(deadline)) throw;  // a read changes nothing: asked again on the new session until then
      }
    }
  });
}

std::int64_t ZookeeperBackend::counter_drain(const std::string& name) {
  const auto deadline = call_deadline();
  auto session = session_for(deadline);
  const auto path = path_of(name) + "/permits";
  const auto what = "PermitCounter::drain_permits() of '" + name + "'";
  return outside_queue("PermitCounter::drain_permits (the change may or may not have been applied)", [&]() -> std::int64_t {
    for (;;) {
      Stat stat{};
      const auto text = read(*session, path, false, deadline, &stat);
      if (!text) return 0;
      const auto count = count_of(*text, name);  // any number: draining resets even a peer's huge count
      const int rc = change_count(*session, path, {Session::Op::set(path, "0", stat.version)}, what, deadline);
      if (rc == ZOK) return saturated(count.value);
      if (rc != kNotApplied && rc != ZNONODE) throw_error("update of '" + path + "'", rc);
    }
  });
}

void ZookeeperBackend::inspect_lock(Session& session, const std::string& path, const std::vector<std::string>& children,
                                    Inspection& result, Deadline deadline) {
  // Who holds is the core's predicate's answer for each entry, downgraded writers as readers.
  std::vector<QueueEntryView> queue;
  std::vector<EntryInfo> infos;
  for (const auto& entry : sorted_entries(children)) {
    Stat stat{};
    const auto data = read(session, path + "/" + entry.node, false, deadline, &stat);
    if (!data) continue;  // left meanwhile
    const auto node = parse_node_data(*data);
    const auto kind = entry.kind == EntryKind::shared || node.downgraded ? EntryKind::shared : EntryKind::exclusive;
    queue.push_back({kind, 1});
    infos.push_back(entry_info(node, stat, to_string(kind)));
    infos.back().permits = 1;
  }
  for (std::size_t i = 0; i < infos.size(); ++i) {
    infos[i].holding = evaluate_queue(queue, i, 0).admitted();
    (infos[i].holding ? result.holders : result.waiters).push_back(std::move(infos[i]));
  }
}

void ZookeeperBackend::inspect_semaphore(Session& session, const std::string& path, Inspection& result, Deadline deadline) {
  const auto holders = sorted_entries(list(session, path + "/leases", false, deadline));
  const auto line = sorted_entries(list(session, path + "/locks", false, deadline));
  if (holders.empty() && line.empty()) return;
  result.mode = "semaphore";
  if (const auto data = read(session, path, false, deadline)) result.limit = recorded_limit(*data).value_or(0);
  // One holder per protection id: a contender's leases share it.
  std::map<std::string, EntryInfo> by_uuid;
  std::vector<std::string> order;
  for (const auto& entry : holders) {
    const auto key = entry.uuid.empty() ? entry.node : entry.uuid;
    auto it = by_uuid.find(key);
    if (it == by_uuid.end()) {
      Stat stat{};
      const auto data = read(session, path + "/leases/" + entry.node, false, deadline, &stat);
      if (!data) continue;  // released meanwhile (its token, the czxid, is read with it)
      order.push_back(key);
      it = by_uuid.emplace(key, entry_info(parse_node_data(*data), stat, "lease")).first;
      it->second.permits = 0;  // counted below, one per lease node
      it->second.holding = true;
    }
    ++it->second.permits;
  }
  for (const auto& key : order) result.holders.push_back(by_uuid[key]);
  for (const auto& entry : line) {
    if (by_uuid.count(entry.uuid)) continue;  // admitted, leaving the line right now
    Stat stat{};
    const auto data = read(session, path + "/locks/" + entry.node, false, deadline, &stat);
    if (!data) continue;
    result.waiters.push_back(entry_info(parse_node_data(*data), stat, "lease"));
  }
}

Inspection ZookeeperBackend::inspect(const std::string& name, Deadline until) {
  auto deadline = call_deadline();
  if (until) deadline = std::min(*deadline, *until);
  auto session = session_for(deadline);
  const auto path = path_of(name);
  return outside_queue("inspect", [&] {
    Inspection result;
    result.name = name;
    const auto children = list(*session, path, false, deadline);
    if (!sorted_entries(children).empty()) {
      result.mode = "lock";
      inspect_lock(*session, path, children, result, deadline);
    } else if (std::find(children.begin(), children.end(), "locks") != children.end() ||
               std::find(children.begin(), children.end(), "leases") != children.end()) {
      inspect_semaphore(*session, path, result, deadline);
    }
    if (const auto value = read(*session, path + "/permits", false, deadline)) {
      if (const auto count = parse_count(*value)) result.permits = saturated(count->value);
    }
    for (const auto& entry : sorted_entries(list(*session, path + "/permit-waiters", false, deadline))) {
      Stat stat{};
      const auto data = read(*session, path + "/permit-waiters/" + entry.node, false, deadline, &stat);
      if (!data) continue;
      result.waiters.push_back(entry_info(parse_node_data(*data), stat, "permits"));
    }
    return result;
  });
}

}  // namespace
}  // namespace turnstile::detail::zookeeper

extern "C" std::unique_ptr<turnstile::detail::Backend> turnstile_backend_factory_v1(
    const turnstile::detail::BackendUrl& url, const turnstile::ClientOptions& options) {
  using namespace turnstile::detail::zookeeper;
  return std::make_unique<ZookeeperBackend>(parse_settings(url, options));
}
