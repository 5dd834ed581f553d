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
// counter, shared by every kind of child), which plus one is the fencing token. A waiter
// watches only the entry it waits for, with getData (a watch on a missing node is never set).
// The `_c_<uuid>-` prefix is Curator's "protection": after a connection loss during create,
// the contender finds its node by the prefix instead of creating a second one, and checks the
// node's ephemeral owner is its own session (CURATOR-604).
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <thread>

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
struct Entry {
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
std::optional<Entry> parse_entry(const std::string& node) {
  std::string_view rest(node);
  Entry entry;
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

std::vector<Entry> sorted_entries(const std::vector<std::string>& children) {
  std::vector<Entry> entries;
  entries.reserve(children.size());
  for (const auto& child : children) {
    if (auto entry = parse_entry(child)) entries.push_back(std::move(*entry));
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.seq < b.seq; });
  return entries;
}

std::size_t index_of(const std::vector<Entry>& entries, const std::string& node) {
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
  bool downgraded = false;
  std::int64_t permits = 1;
};

std::string node_data(const std::string& kind, std::int64_t permits = 1) {
  static const std::string identity = "turnstile pid=" + std::to_string(getpid()) + " host=" + host_name();
  return identity + " kind=" + kind + (permits != 1 ? " permits=" + std::to_string(permits) : "");
}

std::string field(const std::string& data, const std::string& key) {
  const auto at = data.find(" " + key + "=");
  if (at == std::string::npos) return {};
  const auto start = at + key.size() + 2;
  return data.substr(start, data.find(' ', start) - start);
}

NodeInfo parse_node_data(const std::string& data) {
  NodeInfo info;
  if (!data.starts_with("turnstile ")) {
    info.host = data;  // a Curator node: its client's address
    return info;
  }
  info.host = field(data, "host");
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

std::string describe(int rc) { return zerror(rc); }

bool past(Deadline deadline) { return deadline && SteadyClock::now() >= *deadline; }

[[noreturn]] void fail(const std::string& what, int rc) {
  if (rc == ZNOAUTH || rc == ZAUTHFAILED) throw AccessDenied("ZooKeeper refused " + what + ": " + describe(rc));
  throw BackendUnavailable("ZooKeeper " + what + " failed: " + describe(rc));
}

// What inspect shows of one node: its token, its creator (from its data) and its creation time.
EntryInfo entry_info(const Entry& entry, const NodeInfo& node, const Stat& stat, std::string kind) {
  EntryInfo info;
  info.fencing_token = entry.seq + 1;
  info.kind = std::move(kind);
  info.permits = node.permits;
  info.pid = node.pid;
  info.host = node.host;
  info.since = std::chrono::system_clock::time_point(milliseconds(stat.ctime));
  return info;
}

// Thrown inside the backend when its session went away: an acquire starts over on a new one;
// at the backend's boundary everything else translates it (session_expired()), never lets it out.
struct SessionGone {};

[[noreturn]] void session_expired(const std::string& what) {
  throw BackendUnavailable("the ZooKeeper session expired during " + what + "; a new one is being opened");
}

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

class ZookeeperBackend final : public Backend {
 public:
  explicit ZookeeperBackend(Settings settings) : connection_(std::move(settings)) {}

  std::unique_ptr<BackendHold> acquire(const QueueRequest& request, Deadline deadline,
                                       std::shared_ptr<LossSignal> loss) override;
  Inspection inspect(const std::string& name) override;
  bool counter_try_set(const std::string& name, std::int64_t permits) override;
  std::int64_t counter_add(const std::string& name, std::int64_t delta) override;
  std::optional<std::int64_t> counter_get(const std::string& name) override;
  std::int64_t counter_drain(const std::string& name) override;
  bool counter_acquire(const std::string& name, std::int64_t permits, Deadline deadline) override;

  Connection& connection() { return connection_; }

 private:
  // Under a chroot, the chroot's segments are the first ones of every name: the chroot "/app"
  // and the name "x" make the node of the name "app/x" (so "lock-0000000000" under "/app" is
  // app/%6Cock-0000000000, never an entry of the name "app").
  std::string path_of(const std::string& name) const {
    const auto& root = connection_.settings().root;
    return "/" + encode_name(root.empty() ? name : root.substr(root.front() == '/' ? 1 : 0) + "/" + name);
  }
  // Creates every missing node of `path` (and `path` itself) as a container.
  void ensure_path(Session& session, const std::string& path, Deadline deadline);
  // Creates an ephemeral sequential child PARENT/PREFIX<seq> and returns its name (not path).
  // After a connection loss it looks for its own node by the protection prefix.
  std::string create_entry(Session& session, const std::string& parent, const std::string& prefix,
                           const std::string& uuid, const std::string& data, Deadline deadline);
  // Reads, retried over connection losses; throws SessionGone or BackendUnavailable.
  std::vector<std::string> list(Session& session, const std::string& path, bool watch, Deadline deadline,
                                bool missing_is_empty = true);
  std::optional<std::string> read(Session& session, const std::string& path, bool watch, Deadline deadline,
                                  Stat* stat = nullptr);
  // After a create whose reply was lost: our node, if the server made it, found by the
  // protection id; nullopt when it was not made. When that stays unknown past the deadline,
  // hands the look-up to the janitor (which removes the node) and throws BackendUnavailable.
  std::optional<std::string> find_own(Session& session, const std::string& parent, const std::string& uuid,
                                      Deadline deadline);
  // Deletes our node; when the connection is down, the janitor does it once it is back (an
  // entry we gave up on must never stay in line, CURATOR-678). Never blocks past one call.
  void remove_quietly(Session& session, const std::string& path) noexcept;

  std::unique_ptr<BackendHold> acquire_lock(Session& session, const QueueRequest& request, Deadline deadline,
                                            std::shared_ptr<LossSignal>& loss);
  std::unique_ptr<BackendHold> acquire_lease(Session& session, const QueueRequest& request, Deadline deadline,
                                             std::shared_ptr<LossSignal>& loss);
  // Whether a node of ours is gone, after a write whose reply was lost: read after a sync, so a
  // lagging ensemble member cannot answer from before the write. nullopt when the server did
  // not answer by the deadline.
  std::optional<bool> gone(Session& session, const std::string& path, Deadline deadline);
  // Throws InvalidArgument when a lease request cannot be one ZooKeeper transaction.
  void check_lease_request(const QueueRequest& request, const std::string& lease_prefix, const std::string& lease_data);
  // Throws KindMismatch when the semaphore children of a lock path have entries.
  void refuse_semaphore_users(Session& session, const std::string& path, const std::vector<std::string>& children,
                              const QueueRequest& request, Deadline deadline);
  // Waits on `path` (registered before the watch is set) until it changes; false on the
  // deadline or a stop. Returns true at once when the node is already gone, or when
  // `still_blocks` says its data (read with the watch) no longer blocks us.
  bool wait_for_change(Session& session, const std::string& path, Deadline deadline, const std::stop_token& stop = {},
                       const std::function<bool(const std::string&)>& still_blocks = {});
  void inspect_lock(Session& session, const std::string& path, const std::vector<std::string>& children,
                    Inspection& result, Deadline deadline);
  void inspect_semaphore(Session& session, const std::string& path, Inspection& result, Deadline deadline);
  // One change of a PermitCounter's count (`ops`, to which it adds its marker) whose outcome is
  // always known: ZOK when applied, kNotApplied (look again) or the server's refusal when not.
  // Throws BackendUnavailable when that is not known by the deadline.
  int change_count(Session& session, const std::string& count_path, std::vector<Session::Op> ops, const std::string& what,
                   Deadline deadline);

  std::shared_ptr<Session> session_for(Deadline deadline) { return connection_.session(deadline); }
  // Before a retry after connection trouble: a short pause, then no call until the connection
  // is back (a call made while it is down waits inside the C client, past any deadline). False
  // when the deadline passed first.
  bool retry_pause(Session& session, Deadline deadline) {
    std::this_thread::sleep_for(milliseconds(50));
    return connection_.wait_connected(session, deadline) && !past(deadline);
  }
  // For calls that have no deadline of their own (counters, inspect): a session timeout,
  // at least 5 s.
  Deadline call_deadline() const {
    return SteadyClock::now() + std::max(milliseconds(5000), connection_.settings().session_timeout);
  }

  Connection connection_;
  std::atomic<bool> containers_supported_{true};
  friend class ZookeeperHold;
};

void check_session(Session& session, int rc) {
  if (session_gone(rc) || session.expired()) throw SessionGone{};
}

ZookeeperHold::ZookeeperHold(ZookeeperBackend& backend, std::shared_ptr<Session> session, std::vector<std::string> paths,
                             std::uint64_t token, std::shared_ptr<LossSignal> loss)
    : backend_(backend), session_(std::move(session)), paths_(std::move(paths)), token_(token), loss_(std::move(loss)),
      lease_(session_->lease()) {
  lease_->attach(loss_);  // lost at once if the lease is
  // The session may outlive our nodes (deleted by hand or by a peer): watched, so that this
  // hold is told at once rather than never.
  backend_.connection_.watch_held(*session_, paths_, loss_);
}

ZookeeperHold::~ZookeeperHold() {
  backend_.connection_.unwatch_held(paths_);
  if (!released_) lease_->detach(loss_.get());  // the core releases first; this guards misuse
}

void ZookeeperHold::downgrade() {
  // The entry keeps its place and token: its data now says "shared", which turnstile readers
  // behind it read (their watch on it fires). Curator's readers still wait for it: safe.
  const int rc = session_->set(paths_.front(), node_data("downgraded"), -1, SteadyClock::now() + session_->short_wait());
  if (rc == ZOK) return;
  if (rc == ZNONODE || session_gone(rc)) {
    loss_->lose("its ZooKeeper session expired");
    return;
  }
  // Connection trouble: the set may or may not have been applied. Either way the entry is
  // consistent (a writer's or a downgraded one, same place, same token) and setting it again
  // is idempotent: the core retries, or releases the hold whole.
  fail("downgrade of '" + paths_.front() + "'", rc);
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
    backend_.connection_.unwatch_held(paths_);
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
    throw BackendUnavailable("ZooKeeper release of '" + paths_.front() + "' failed: " + describe(rc));
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
  fail("release of '" + paths_.front() + "'", rc);
}

void ZookeeperBackend::ensure_path(Session& session, const std::string& path, Deadline deadline) {
  // Top down: each level exists or is created; a container left empty is reaped by the server.
  for (std::size_t slash = path.find('/', 1);; slash = path.find('/', slash + 1)) {
    const auto prefix = slash == std::string::npos ? path : path.substr(0, slash);
    for (;;) {
      const int flags = containers_supported_ ? ZOO_CONTAINER : ZOO_PERSISTENT;
      const int rc = session.create(prefix, "", flags, deadline);
      if (rc == ZOK || rc == ZNODEEXISTS) break;
      if (rc == ZUNIMPLEMENTED && containers_supported_) {
        containers_supported_ = false;  // a server before 3.5: persistent parents, as Curator does
        continue;
      }
      check_session(session, rc);
      if (connection_trouble(rc) && retry_pause(session, deadline)) continue;
      fail("create of '" + prefix + "'", rc);
    }
    if (slash == std::string::npos) break;
  }
}

std::string ZookeeperBackend::create_entry(Session& session, const std::string& parent, const std::string& prefix,
                                           const std::string& uuid, const std::string& data, Deadline deadline) {
  const auto path = parent + "/" + prefix;
  for (;;) {
    std::string created;
    const int rc = session.create(path, data, ZOO_EPHEMERAL_SEQUENTIAL, deadline, &created);
    if (rc == ZOK) return created.substr(parent.size() + 1);
    if (rc == ZNONODE) {
      ensure_path(session, parent, deadline);  // first use, or the server reaped the empty container
      continue;
    }
    check_session(session, rc);
    if (!connection_trouble(rc)) fail("create under '" + parent + "'", rc);
    if (auto mine = find_own(session, parent, uuid, deadline)) return *mine;
    // Not made: create it again (same protection id, so a second loss is resolved alike).
  }
}

std::optional<std::string> ZookeeperBackend::find_own(Session& session, const std::string& parent, const std::string& uuid,
                                                      Deadline deadline) {
  for (;;) {
    std::vector<std::string> mine;
    // Past the deadline (the create itself waited that long): the janitor's job, not the caller's.
    const int rc = past(deadline)             ? ZOPERATIONTIMEOUT
                   : session.connected() ? own_children(session, parent, uuid, deadline, &mine)
                                         : ZCONNECTIONLOSS;
    if (rc == ZOK) return mine.empty() ? std::nullopt : std::optional(mine.front());
    check_session(session, rc);
    if (!connection_trouble(rc) || !retry_pause(session, deadline)) {
      // Still unknown: the janitor finds and removes it once the connection is back, so it
      // never waits in line (or holds) for nobody.
      connection_.remove_later({session.weak_from_this(), "", parent, uuid});
      throw BackendUnavailable("ZooKeeper did not confirm a create under '" + parent + "' (" + describe(rc) +
                               "); its node, if it was made, is removed once the connection is back");
    }
    std::this_thread::sleep_for(milliseconds(50));
  }
}

std::vector<std::string> ZookeeperBackend::list(Session& session, const std::string& path, bool watch, Deadline deadline,
                                                bool missing_is_empty) {
  for (;;) {
    std::vector<std::string> children;
    const int rc = session.children(path, watch, deadline, &children);
    if (rc == ZOK) return children;
    if (rc == ZNONODE && missing_is_empty) return {};
    check_session(session, rc);
    if (!connection_trouble(rc) || !retry_pause(session, deadline)) fail("listing of '" + path + "'", rc);
  }
}

std::optional<std::string> ZookeeperBackend::read(Session& session, const std::string& path, bool watch, Deadline deadline,
                                                  Stat* stat) {
  for (;;) {
    std::string data;
    const int rc = session.get(path, watch, deadline, &data, stat);
    if (rc == ZOK) return data;
    if (rc == ZNONODE) return std::nullopt;
    check_session(session, rc);
    if (!connection_trouble(rc) || !retry_pause(session, deadline)) fail("read of '" + path + "'", rc);
  }
}

void ZookeeperBackend::remove_quietly(Session& session, const std::string& path) noexcept {
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

bool ZookeeperBackend::wait_for_change(Session& session, const std::string& path, Deadline deadline,
                                       const std::stop_token& stop,
                                       const std::function<bool(const std::string&)>& still_blocks) {
  Waiter waiter;
  connection_.watch(path, &waiter);
  struct Unwatch {
    Connection& connection;
    const std::string& path;
    Waiter* waiter;
    ~Unwatch() { connection.unwatch(path, waiter); }
  } unwatch{connection_, path, &waiter};
  // getData, not exists: a node already gone leaves no watch behind. The read that sets the
  // watch is the one that decides: a change between a first look and the watch is not missed.
  const auto data = read(session, path, true, deadline);
  if (!data || (still_blocks && !still_blocks(*data))) return true;
  const bool in_time = connection_.sleep(waiter, deadline, stop);
  check_session(session, ZOK);
  return in_time;
}

std::unique_ptr<BackendHold> ZookeeperBackend::acquire(const QueueRequest& request, Deadline deadline,
                                                       std::shared_ptr<LossSignal> loss) {
  // A session that expires while we wait took our entry with it: join again on the new one.
  for (;;) {
    if (request.stop.stop_requested()) return nullptr;
    auto session = session_for(deadline);
    try {
      return request.kind == EntryKind::lease ? acquire_lease(*session, request, deadline, loss)
                                              : acquire_lock(*session, request, deadline, loss);
    } catch (const SessionGone&) {
      if (past(deadline)) return nullptr;
    }
  }
}

std::optional<bool> ZookeeperBackend::gone(Session& session, const std::string& path, Deadline deadline) {
  for (;;) {
    if (past(deadline)) return std::nullopt;  // the janitor's job now
    int rc = session.sync(path.substr(0, path.rfind('/')), deadline);
    if (rc == ZOK) rc = session.exists(path, false, deadline);
    if (rc == ZOK) return false;
    if (rc == ZNONODE) return true;
    check_session(session, rc);
    if (!connection_trouble(rc) || !retry_pause(session, deadline)) return std::nullopt;
  }
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

// A SharedMutex writer's node is named as Curator's write lock names it (__WRIT__), a Mutex's
// as InterProcessMutex's (lock-).
bool is_shared_mutex_writer(const QueueRequest& request) {
  return request.kind == EntryKind::exclusive && request.primitive == Primitive::shared_mutex;
}

void ZookeeperBackend::refuse_semaphore_users(Session& session, const std::string& path,
                                              const std::vector<std::string>& children, const QueueRequest& request,
                                              Deadline deadline) {
  for (const auto& child : children) {
    if (child != "locks" && child != "leases") continue;
    Stat stat{};
    const int rc = session.exists(path + "/" + child, false, deadline, &stat);
    check_session(session, rc);
    if (rc == ZOK && stat.numChildren > 0) {
      Stat parent{};
      const auto data = read(session, path, false, deadline, &parent);
      check_queue_mode(request, QueueMode::semaphore, data ? recorded_limit(*data).value_or(0) : 0);
    }
  }
}

std::unique_ptr<BackendHold> ZookeeperBackend::acquire_lock(Session& session, const QueueRequest& request, Deadline deadline,
                                                            std::shared_ptr<LossSignal>& loss) {
  const bool try_once = deadline && *deadline <= SteadyClock::now();
  if (try_once) deadline = SteadyClock::now() + session.short_wait();  // for the calls: it never waits in line
  const auto path = path_of(request.name);
  const auto uuid = random_uuid();
  const char* label = request.kind == EntryKind::shared ? kReadLabel
                      : is_shared_mutex_writer(request) ? kWriteLabel
                                                        : kMutexLabel;
  const auto mine = create_entry(session, path, "_c_" + uuid + "-" + label, uuid,
                                 node_data(request.kind == EntryKind::shared ? "shared" : "exclusive"), deadline);
  const auto my_path = path + "/" + mine;
  try {
    for (;;) {
      auto children = list(session, path, false, deadline);
      // A semaphore on the same name is a kind mismatch (we joined first, then looked: of two
      // racing contenders at least one sees the other).
      refuse_semaphore_users(session, path, children, request, deadline);
      auto entries = sorted_entries(children);
      const auto me = index_of(entries, mine);
      if (me == entries.size()) throw SessionGone{};  // our ephemeral node is gone
      // Whom we wait for: an exclusive entry waits for the one just ahead; a shared one for
      // the nearest exclusive entry ahead that was not downgraded.
      std::optional<std::string> blocker;
      std::function<bool(const std::string&)> still_blocks;
      bool stale = false;  // an entry we looked at left meanwhile: list again
      if (request.kind == EntryKind::exclusive) {
        if (me > 0) blocker = path + "/" + entries[me - 1].node;
      } else {
        for (std::size_t i = me; i-- > 0;) {
          if (entries[i].kind != EntryKind::exclusive) continue;
          const auto ahead = path + "/" + entries[i].node;
          const auto data = read(session, ahead, false, deadline);
          if (!data) {
            stale = true;
            break;
          }
          if (parse_node_data(*data).downgraded) continue;
          blocker = ahead;
          // Decided again from the data read with the watch: a downgrade between this look
          // and the watch must not leave us waiting for a change that already happened.
          still_blocks = [](const std::string& now) { return !parse_node_data(now).downgraded; };
          break;
        }
      }
      if (stale) continue;
      if (!blocker) {
        return std::make_unique<ZookeeperHold>(*this, session.shared_from_this(), std::vector<std::string>{my_path},
                                               entries[me].seq + 1, std::move(loss));
      }
      // A long queue's listing is not kept while we sleep: memory per waiter stays constant.
      decltype(children)().swap(children);
      decltype(entries)().swap(entries);
      if (try_once || !wait_for_change(session, *blocker, deadline, request.stop, still_blocks)) {
        remove_quietly(session, my_path);
        return nullptr;
      }
    }
  } catch (const SessionGone&) {
    throw;
  } catch (...) {
    remove_quietly(session, my_path);
    throw;
  }
}

std::unique_ptr<BackendHold> ZookeeperBackend::acquire_lease(Session& session, const QueueRequest& request, Deadline deadline,
                                                             std::shared_ptr<LossSignal>& loss) {
  const bool try_once = deadline && *deadline <= SteadyClock::now();
  if (try_once) deadline = SteadyClock::now() + session.short_wait();  // for the calls: it never waits in line
  const auto path = path_of(request.name);
  const auto line = path + "/locks";
  const auto leases = path + "/leases";
  const auto uuid = random_uuid();
  const auto lease_prefix = leases + "/_c_" + uuid + "-" + kLeaseLabel;
  const auto lease_data = node_data("lease", request.permits);
  check_lease_request(request, lease_prefix, lease_data);
  // The line is InterProcessSemaphoreV2's `locks` mutex: its head alone may add leases.
  const auto mine = create_entry(session, line, "_c_" + uuid + "-" + kMutexLabel, uuid, node_data("lease", request.permits), deadline);
  const auto my_path = line + "/" + mine;
  try {
    // A lock on the same name is a kind mismatch (joined first, then looked).
    for (const auto& entry : sorted_entries(list(session, path, false, deadline))) {
      (void)entry;
      check_queue_mode(request, QueueMode::lock, 0);
    }
    bool limit_checked = false;
    for (;;) {
      const auto entries = sorted_entries(list(session, line, false, deadline));
      const auto me = index_of(entries, mine);
      if (me == entries.size()) throw SessionGone{};
      if (me > 0) {
        if (!limit_checked) {
          // Queued behind others: refuse a disagreeing limit now rather than after the wait.
          limit_checked = true;
          const auto data = read(session, path, false, deadline);
          const auto limit = data ? recorded_limit(*data) : std::nullopt;
          if (limit && *limit != request.limit && !list(session, leases, false, deadline).empty()) {
            check_queue_mode(request, QueueMode::semaphore, *limit);
          }
        }
        if (try_once || !wait_for_change(session, line + "/" + entries[me - 1].node, deadline, request.stop)) {
          remove_quietly(session, my_path);
          return nullptr;
        }
        continue;
      }
      // At the head of the line: count the leases, watching them for a release.
      Stat semaphore_stat{};
      const auto data = read(session, path, false, deadline, &semaphore_stat);
      if (!data) throw SessionGone{};  // the parent of our node cannot be gone while we live
      const auto limit = recorded_limit(*data);
      Waiter waiter;
      connection_.watch(leases, &waiter);
      struct Unwatch {
        Connection& connection;
        const std::string& path;
        Waiter* waiter;
        ~Unwatch() { connection.unwatch(path, waiter); }
      } unwatch{connection_, leases, &waiter};
      const auto held = list(session, leases, !try_once, deadline);
      const auto held_leases = sorted_entries(held).size();
      if (held_leases > 0 && limit && *limit != request.limit) check_queue_mode(request, QueueMode::semaphore, *limit);
      // More leases held than our limit allows: someone with a larger limit took them (Curator's
      // InterProcessSemaphoreV2 records no limit and checks none). Contenders that agree with
      // us cannot get here: only the head of the line adds leases, within its limit (turnstile:
      // in the transaction that leaves the line; Curator: its lease node exists before its
      // count check only while it heads the line), and we are the head now. Waiting would
      // starve us silently behind a disagreement, so refuse it as a recorded one is refused.
      // (One blind spot: a Curator contender that timed out during a connection loss retries
      // the deletes of its lease and of its line node in the background, in either order.)
      if (static_cast<std::int64_t>(held_leases) > request.limit) {
        throw LimitMismatch("Semaphore '" + request.name + "' has " + std::to_string(held_leases) +
                            " leases held, more than this contender's limit " + std::to_string(request.limit) +
                            ": another contender (e.g. Curator's InterProcessSemaphoreV2) uses a larger limit");
      }
      if (static_cast<std::int64_t>(held_leases) + request.permits <= request.limit) {
        // One transaction: record the limit (if it changes), add our leases, leave the line.
        // Nothing half-done can leak (CURATOR-315 and kin).
        const auto limit_text = "limit=" + std::to_string(request.limit);
        std::vector<Session::Op> ops;
        ops.reserve(static_cast<std::size_t>(request.permits) + 2);
        if (limit != request.limit) ops.push_back(Session::Op::set(path, limit_text, semaphore_stat.version));
        for (std::int64_t i = 0; i < request.permits; ++i) {
          ops.push_back(Session::Op::create(lease_prefix, lease_data, ZOO_EPHEMERAL_SEQUENTIAL));
        }
        ops.push_back(Session::Op::remove(my_path));
        std::vector<std::string> created;
        const int rc = session.multi(ops, deadline, &created);
        if (rc == ZBADVERSION) continue;  // someone else recorded a limit meanwhile: look again
        if (rc == ZNONODE) {
          ensure_path(session, leases, deadline);
          continue;
        }
        check_session(session, rc);
        if (connection_trouble(rc)) {
          // Unknown outcome: applied iff our place in line is gone (and our leases exist).
          // "Gone" only on the server's word (ZNONODE after a sync), never on a failed look.
          const auto applied = gone(session, my_path, deadline);
          if (!applied) {
            // Still unknown: whatever the multi left of ours is removed once the connection
            // is back (the line node by the catch below), never left to hold for nobody.
            connection_.remove_later({session.weak_from_this(), "", leases, uuid});
            throw BackendUnavailable("ZooKeeper did not confirm the leases of '" + request.name +
                                     "'; any it made are removed once the connection is back");
          }
          if (!*applied) continue;  // not applied: still heading the line
          std::vector<std::string> paths;
          std::uint64_t first_seq = ~0ULL;
          try {
            for (const auto& entry : sorted_entries(list(session, leases, false, deadline))) {
              if (entry.uuid != uuid) continue;
              paths.push_back(leases + "/" + entry.node);
              first_seq = std::min(first_seq, entry.seq);
            }
          } catch (const BackendUnavailable&) {
            connection_.remove_later({session.weak_from_this(), "", leases, uuid});
            throw;
          }
          if (paths.empty()) throw SessionGone{};  // our line node was removed under us
          return std::make_unique<ZookeeperHold>(*this, session.shared_from_this(), std::move(paths), first_seq + 1,
                                                 std::move(loss));
        }
        if (rc != ZOK) fail("lease of '" + path + "'", rc);
        std::vector<std::string> paths;
        std::uint64_t first_seq = ~0ULL;
        for (auto& lease : created) {
          if (auto entry = parse_entry(lease.substr(lease.rfind('/') + 1))) first_seq = std::min(first_seq, entry->seq);
          paths.push_back(std::move(lease));
        }
        return std::make_unique<ZookeeperHold>(*this, session.shared_from_this(), std::move(paths), first_seq + 1,
                                               std::move(loss));
      }
      if (try_once || !connection_.sleep(waiter, deadline, request.stop)) {
        remove_quietly(session, my_path);
        return nullptr;
      }
      check_session(session, ZOK);
    }
  } catch (const SessionGone&) {
    throw;
  } catch (...) {
    remove_quietly(session, my_path);
    throw;
  }
}

void ZookeeperBackend::inspect_lock(Session& session, const std::string& path, const std::vector<std::string>& children,
                                    Inspection& result, Deadline deadline) {
  bool exclusive_ahead = false;
  bool first = true;
  for (const auto& entry : sorted_entries(children)) {
    Stat stat{};
    const auto data = read(session, path + "/" + entry.node, false, deadline, &stat);
    if (!data) continue;  // left meanwhile
    const auto node = parse_node_data(*data);
    auto info = entry_info(entry, node, stat, entry.kind == EntryKind::shared || node.downgraded ? "shared" : "exclusive");
    info.permits = 1;
    info.holding = info.kind == "exclusive" ? first : !exclusive_ahead;
    if (info.kind == "exclusive") exclusive_ahead = true;
    first = false;
    (info.holding ? result.holders : result.waiters).push_back(std::move(info));
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
    auto [it, added] = by_uuid.try_emplace(key);
    auto& info = it->second;
    if (added) {
      order.push_back(key);
      Stat stat{};
      const auto data = read(session, path + "/leases/" + entry.node, false, deadline, &stat);
      info = entry_info(entry, parse_node_data(data.value_or("")), stat, "lease");
      info.permits = 0;  // counted below, one per lease node
      info.holding = true;
    }
    ++info.permits;
  }
  for (const auto& key : order) result.holders.push_back(by_uuid[key]);
  for (const auto& entry : line) {
    if (by_uuid.count(entry.uuid)) continue;  // admitted, leaving the line right now
    Stat stat{};
    const auto data = read(session, path + "/locks/" + entry.node, false, deadline, &stat);
    if (!data) continue;
    result.waiters.push_back(entry_info(entry, parse_node_data(*data), stat, "lease"));
  }
}

Inspection ZookeeperBackend::inspect(const std::string& name) {
  const auto deadline = call_deadline();
  auto session = session_for(deadline);
  Inspection result;
  result.name = name;
  const auto path = path_of(name);
  try {
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
      result.waiters.push_back(entry_info(entry, parse_node_data(*data), stat, "permits"));
    }
  } catch (const SessionGone&) {
    throw BackendUnavailable("the ZooKeeper session expired during inspect");
  }
  return result;
}

// PermitCounter: the count is the text of ROOT/NAME/permits, changed only by a transaction that
// names the version it read (compare-and-set) and makes a marker node of its own (below), so a
// change whose reply was lost is known to have happened or not. Waiters line up as ephemeral
// sequential nodes; the head watches the count, the others their predecessor.
//
// A session that expires during a call is BackendUnavailable at this boundary (SessionGone
// never leaves the backend); calls without a deadline of their own give up after
// call_deadline().

// The answer of change_count when a change whose reply was lost turned out not applied: the
// caller looks again, as after losing a race.
constexpr int kNotApplied = ZBADVERSION;

int ZookeeperBackend::change_count(Session& session, const std::string& count_path, std::vector<Session::Op> ops,
                                   const std::string& what, Deadline deadline) {
  // The marker: an ephemeral child of the count's node, made by the same transaction, so that
  // after a lost reply its presence (read after a sync) says whether the change was applied.
  // Nobody else makes it (its name is random) and no name reaches it (a `permits` segment is
  // encoded). A value and version read back would not do: a peer that read the same version
  // may have written the same text.
  const auto marker = count_path + "/_c_" + random_uuid() + "-change";
  ops.push_back(Session::Op::create(marker, "", ZOO_EPHEMERAL));
  const int rc = session.multi(ops, deadline);
  if (rc == ZOK) {
    remove_quietly(session, marker);
    return ZOK;
  }
  check_session(session, rc);
  if (!connection_trouble(rc)) return rc;
  // Unknown outcome. Resent never (it could apply twice): decided by the marker, on the
  // server's word after a sync; the transaction cannot still be applied after that (a
  // session's requests are applied in order, and the old connection's are done before the
  // new one is served).
  const auto absent = gone(session, marker, deadline);
  if (!absent) {
    connection_.remove_later({session.weak_from_this(), marker, "", ""});
    throw BackendUnavailable("ZooKeeper did not confirm " + what + " in time: it may or may not have been applied");
  }
  if (*absent) return kNotApplied;
  remove_quietly(session, marker);
  return ZOK;
}

bool ZookeeperBackend::counter_try_set(const std::string& name, std::int64_t permits) {
  const auto deadline = call_deadline();
  auto session = session_for(deadline);
  const auto path = path_of(name) + "/permits";
  const auto what = "PermitCounter::try_set_permits(" + std::to_string(permits) + ") of '" + name + "'";
  try {
    for (;;) {
      const int rc = change_count(*session, path, {Session::Op::create(path, std::to_string(permits), ZOO_PERSISTENT)},
                                  what, deadline);
      if (rc == ZOK) return true;
      if (rc == ZNODEEXISTS) return false;
      if (rc == kNotApplied) continue;
      if (rc == ZNONODE) {
        ensure_path(*session, path_of(name), deadline);
        continue;
      }
      fail("create of '" + path + "'", rc);
    }
  } catch (const SessionGone&) {
    session_expired("PermitCounter::try_set_permits (the change may or may not have been applied)");
  }
}

std::int64_t ZookeeperBackend::counter_add(const std::string& name, std::int64_t delta) {
  const auto deadline = call_deadline();
  auto session = session_for(deadline);
  const auto path = path_of(name) + "/permits";
  const auto what = "PermitCounter::add_permits(" + std::to_string(delta) + ") of '" + name + "'";
  try {
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
      if (rc == kNotApplied || rc == ZNODEEXISTS) continue;
      if (rc == ZNONODE) {
        if (!text) ensure_path(*session, path_of(name), deadline);
        continue;
      }
      fail("update of '" + path + "'", rc);
    }
  } catch (const SessionGone&) {
    session_expired("PermitCounter::add_permits (the change may or may not have been applied)");
  }
}

std::optional<std::int64_t> ZookeeperBackend::counter_get(const std::string& name) {
  const auto deadline = call_deadline();
  for (;;) {
    auto session = session_for(deadline);
    try {
      const auto text = read(*session, path_of(name) + "/permits", false, deadline);
      if (!text) return std::nullopt;
      return saturated(count_of(*text, name).value);
    } catch (const SessionGone&) {
      if (past(deadline)) session_expired("PermitCounter::available_permits");
    }
  }
}

std::int64_t ZookeeperBackend::counter_drain(const std::string& name) {
  const auto deadline = call_deadline();
  auto session = session_for(deadline);
  const auto path = path_of(name) + "/permits";
  const auto what = "PermitCounter::drain_permits() of '" + name + "'";
  try {
    for (;;) {
      Stat stat{};
      const auto text = read(*session, path, false, deadline, &stat);
      if (!text) return 0;
      const auto count = count_of(*text, name);  // any number: draining resets even a peer's huge count
      const int rc = change_count(*session, path, {Session::Op::set(path, "0", stat.version)}, what, deadline);
      if (rc == ZOK) return saturated(count.value);
      if (rc == kNotApplied || rc == ZNONODE) continue;
      fail("update of '" + path + "'", rc);
    }
  } catch (const SessionGone&) {
    session_expired("PermitCounter::drain_permits (the change may or may not have been applied)");
  }
}

bool ZookeeperBackend::counter_acquire(const std::string& name, std::int64_t permits, Deadline deadline) {
  const bool try_once = deadline && *deadline <= SteadyClock::now();
  if (try_once) deadline = SteadyClock::now() + session_for(deadline)->short_wait();  // for the calls: it never waits
  const auto base = path_of(name);
  const auto count_path = base + "/permits";
  const auto line = base + "/permit-waiters";
  for (;;) {
    auto session = session_for(deadline);
    try {
      // Nobody in line: take the permits at once if they are there.
      if (list(*session, line, false, deadline).empty()) {
        Stat stat{};
        const auto text = read(*session, count_path, false, deadline, &stat);
        const Count count = text ? count_of(*text, name) : Count{};
        if (text && count.value >= permits) {
          require_exact(count, name);
          const int rc = change_count(*session, count_path, {Session::Op::set(count_path, count_text(count.value - permits), stat.version)},
                                      "PermitCounter::acquire(" + std::to_string(permits) + ") of '" + name + "'", deadline);
          if (rc == ZOK) return true;
          if (rc != kNotApplied && rc != ZNONODE) fail("update of '" + count_path + "'", rc);
          continue;
        }
        if (try_once) return false;
      } else if (try_once) {
        return false;
      }
      const auto uuid = random_uuid();
      const auto mine = create_entry(*session, line, "_c_" + uuid + "-" + kWaitLabel, uuid, node_data("permits", permits), deadline);
      const auto my_path = line + "/" + mine;
      try {
        for (;;) {
          const auto entries = sorted_entries(list(*session, line, false, deadline));
          const auto me = index_of(entries, mine);
          if (me == entries.size()) throw SessionGone{};
          if (me > 0) {
            if (!wait_for_change(*session, line + "/" + entries[me - 1].node, deadline)) {
              remove_quietly(*session, my_path);
              return false;
            }
            continue;
          }
          Waiter waiter;
          connection_.watch(count_path, &waiter);
          struct Unwatch {
            Connection& connection;
            const std::string& path;
            Waiter* waiter;
            ~Unwatch() { connection.unwatch(path, waiter); }
          } unwatch{connection_, count_path, &waiter};
          Stat stat{};
          const auto text = read(*session, count_path, true, deadline, &stat);
          if (!text) {
            const int rc = session->exists(count_path, true, deadline);  // a watch for its creation
            check_session(*session, rc);
            if (rc == ZOK) continue;
          }
          const Count count = text ? count_of(*text, name) : Count{};
          if (text && count.value >= permits) {
            require_exact(count, name);
            // Take them and leave the line in one transaction.
            const auto left = count_text(count.value - permits);
            const int rc = session->multi({Session::Op::set(count_path, left, stat.version), Session::Op::remove(my_path)}, deadline);
            if (rc == ZOK) return true;
            check_session(*session, rc);
            if (rc == ZBADVERSION) continue;
            if (!connection_trouble(rc)) fail("update of '" + count_path + "'", rc);
            // Unknown outcome: applied iff our place in line is gone, on the server's word
            // after a sync (never twice: a resend could take the permits again).
            const auto applied = gone(*session, my_path, deadline);
            if (!applied) {
              throw BackendUnavailable("ZooKeeper did not confirm PermitCounter::acquire(" + std::to_string(permits) +
                                       ") of '" + name + "' in time: it may or may not have been applied");
            }
            if (*applied) return true;
            continue;
          }
          if (!connection_.sleep(waiter, deadline)) {
            remove_quietly(*session, my_path);
            return false;
          }
          check_session(*session, ZOK);
        }
      } catch (const SessionGone&) {
        throw;
      } catch (...) {
        remove_quietly(*session, my_path);
        throw;
      }
    } catch (const SessionGone&) {
      if (past(deadline)) return false;
    }
  }
}

}  // namespace
}  // namespace turnstile::detail::zookeeper

extern "C" std::unique_ptr<turnstile::detail::Backend> turnstile_backend_factory_v1(
    const turnstile::detail::BackendUrl& url, const turnstile::ClientOptions& options) {
  using namespace turnstile::detail::zookeeper;
  return std::make_unique<ZookeeperBackend>(parse_settings(url, options));
}
