// SPDX-License-Identifier: Apache-2.0
// turnstile::Client: one connection to a coordination backend, the factory of every primitive.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "turnstile/deadline.hpp"
#include "turnstile/error.hpp"
#include "turnstile/metrics.hpp"

namespace turnstile {

class Mutex;
class RecursiveMutex;
class SharedMutex;
class Semaphore;
class PermitCounter;
class Election;

namespace detail {
class ClientState;
}

using ErrorHandler = std::function<void(const Error&)>;

// The largest Semaphore limit, permit count per acquire, PermitCounter value and PermitCounter
// change (add/try_set) any backend accepts: 10^12. Larger values throw InvalidArgument before
// anything is written. Every backend carries numbers up to it exactly (Redis' Lua prints
// integers below 10^14 exactly; sums of permits stay below 2^53).
inline constexpr std::int64_t max_permits = 1'000'000'000'000;

// The library's version, "MAJOR.MINOR.PATCH" (the one it was built as, not the headers').
const char* version() noexcept;

// What a holder may assume about its hold: Curator's connection states, told per hold.
enum class HoldState : std::uint8_t {
  held,  // the backend confirmed it recently enough
  // The connection to the backend is down, but the hold may still be alive there (its session
  // or lease has not run out). Act as if it were not held (pause the work it protects) until
  // it is held again, or lost.
  suspended,
  lost,  // it may have been lost (final): its lost_token() is signalled
};
const char* to_string(HoldState state) noexcept;

// One change of a hold's state, as ClientOptions::on_hold_state receives it.
struct HoldStateChange {
  std::string name;
  std::uint64_t fencing_token = 0;
  HoldState state = HoldState::held;
  std::string reason;  // why it was suspended or lost; empty when it is held again
  // On loss by the loss rule (no renewal confirmed in time): how long from now before the
  // server could hand the hold to someone else. Zero when it may have done so already (the
  // server said the entry is gone) and on every other change.
  std::chrono::milliseconds margin{0};
};
using HoldStateHandler = std::function<void(const HoldStateChange&)>;

struct ClientOptions {
  // Lease time-to-live of holds on backends that expire them (redis, etcd, zk session);
  // zero keeps the URL's ?ttl= or the backend default. The embedded backend ignores it:
  // its holds live exactly as long as the holding process.
  std::chrono::milliseconds ttl{0};
  // Receives errors that cannot be thrown: misuse of unlock(), failed background releases.
  // Default: one line on stderr.
  ErrorHandler error_handler;
  // Called (from a background thread) whenever a hold may have been lost, in addition to
  // the hold's stop token being signalled. The error is a HoldLost naming the hold.
  ErrorHandler on_hold_lost;
  // Called (from a background thread) on every change of a hold's state: held to suspended,
  // suspended to held again, either to lost. Changes of one hold arrive in order. The file://
  // backend never suspends; the network backends suspend while they cannot reach the server.
  HoldStateHandler on_hold_state;
  // How long Client::connect may take to reach the server (zero: the backend's own bound: 5 s
  // on redis and etcd, 10 s on Consul, min(session timeout, 15 s) but at least 5 s on ZooKeeper). A
  // network backend that cannot reach it in time throws BackendUnavailable, saying the connect
  // timed out. A connection refused by every listed server is a definite answer: it fails at
  // once on every backend ("connection refused"); a server that accepts and then says nothing,
  // or does not answer at all, might still answer, and is waited for until then.
  std::chrono::milliseconds connect_timeout{0};
  // A free-form label for this client's holds and waits (consul lock's -name), shown by
  // inspect beside pid@host. At most 256 bytes; control characters are refused.
  std::string holder_label;
  // unlock() (and a guard's or a Lease's end) sends the release and returns without waiting for
  // the server's answer, where the backend can order it before this client's next request on the
  // same connection (Redis, ZooKeeper): about one round trip less per hold. Its failures still
  // reach the error handler and are retried; a lost hold still reports HoldLost; the client's end
  // waits (at most 1 s) for the answers. But another client's try_lock() right after unlock()
  // may still find the name busy for that round trip. Off by default: unlock() returns once the
  // server has the release, as Curator's and Redisson's unlock() do. release() always waits.
  bool unlock_without_waiting = false;
  // The threads that drive this client's async acquires (lock_async and the others, see
  // turnstile/async.hpp): their storage calls, completion callbacks and resumed coroutines run
  // there, while the acquires waiting in line take none. 1 to 64; started on the first async
  // acquire.
  std::size_t async_threads = 2;
  // Client::metrics() labels acquires, holds, suspensions and losses with their name too. Off by
  // default, to keep the number of series bounded: on, the first 1,000 names get series of
  // their own and every later one shares name="/other", which no name can be (each name costs
  // about 5 KiB). Taking a name's series then takes a lock once per acquire.
  bool metrics_name_label = false;
  // Called on every acquire's end, hold's release, state change, renewal and (re)connection
  // (see turnstile/metrics.hpp; json_lines_sink writes them as JSON lines), in order, on a
  // thread of the client's own: no acquire, renewal or watcher thread waits for it. Up to
  // 10,000 events wait for a slow hook; later ones are dropped and counted
  // (turnstile_events_dropped_total), as are those still waiting 1 s after the client ends.
  // It may call this client's metrics(); exceptions it throws are ignored.
  EventHandler on_event;
};

// One entry of a queue as `turnstile inspect` shows it.
struct EntryInfo {
  std::uint64_t fencing_token = 0;
  std::string kind;  // "exclusive", "shared" or "lease"
  std::int64_t permits = 1;
  bool holding = false;
  std::int64_t pid = 0;
  std::string host;
  std::chrono::system_clock::time_point since;
  std::string label;  // the holder's ClientOptions::holder_label ("" when none)
  // A holder that is not turnstile's (an etcdctl, Curator, Redisson or Consul client): `foreign`
  // names it (e.g. "consul session 8248…"); pid, host and since are then unknown (0, "", epoch).
  std::string foreign;
  // Set when its holder gave it up with release_after (--hold-at-least): it holds on its own
  // until about then, by the server's clock.
  std::optional<std::chrono::system_clock::time_point> kept_until;
  // A candidate's value in an election (Client::election; "" in other queues).
  std::string value;
};

struct Inspection {
  std::string name;
  std::string mode;                     // "lock", "semaphore", "election" or "" when nobody is queued
  std::int64_t limit = 0;               // the Semaphore's limit when mode == "semaphore"
  std::vector<EntryInfo> holders;       // in queue order
  std::vector<EntryInfo> waiters;       // in queue order
  std::optional<std::int64_t> permits;  // the PermitCounter's value, if ever set
};

// One name whose queue has holders or waiters, as `turnstile inspect` without NAME lists it.
struct NameInUse {
  std::string name;
  std::string mode;        // "lock", "semaphore" or "election"
  std::int64_t limit = 0;  // the Semaphore's limit when mode == "semaphore"
  std::size_t holders = 0;
  std::size_t waiters = 0;
};

struct NamesInUse {
  std::vector<NameInUse> names;  // in byte order of the names
  // More names were (or may have been) in use than listed: the listing stopped at max_names, or
  // the backend's scan stopped at its own bound (see Client::names_in_use).
  bool truncated = false;
};

class Client {
 public:
  // The URL in TURNSTILE_BACKEND, else the embedded default (see default_url()).
  static Client connect();
  static Client connect(ClientOptions options);
  // `file:///dir` today; redis://, zk://, etcd://, consul:// when their backends are built.
  // Throws InvalidUrl (malformed, unknown scheme), BackendNotBuilt, BackendUnavailable,
  // AccessDenied (the backend refused the credentials). "" and "file://" mean default_url().
  static Client connect(std::string_view url, ClientOptions options = {});
  // The embedded default: file:///run/lock/turnstile, the host-wide directory (shared by the
  // turnstile group; made by the Debian package), where it exists and this process may use it
  // (root, or a member of its group); else the private file:///run/lock/turnstile-$UID (the same
  // for every process of the user, whatever its environment), or file:///tmp/turnstile-$UID
  // where /run/lock is missing.
  static std::string default_url();
  static constexpr const char* host_wide_directory = "/run/lock/turnstile";

  const std::string& url() const;

  // Primitives are cheap handles. Names are '/'-separated paths of non-empty segments,
  // at most 255 bytes of UTF-8 without control characters, '.' or '..' segments;
  // anything else throws InvalidArgument.
  Mutex mutex(std::string_view name);
  RecursiveMutex recursive_mutex(std::string_view name);
  SharedMutex shared_mutex(std::string_view name);
  // Throws InvalidArgument when limit <= 0.
  Semaphore semaphore(std::string_view name, std::int64_t limit);
  PermitCounter permit_counter(std::string_view name);
  // Leader election on `name` (turnstile/election.hpp). Throws InvalidArgument (a bad name, or
  // a backend that has no election layout yet: the message names it).
  Election election(std::string_view name);

  // Holders and waiters of a name, in queue order. Throws InvalidArgument, BackendUnavailable.
  Inspection inspect(std::string_view name);
  // The same, giving up (BackendUnavailable) at `deadline` when the server does not answer.
  Inspection inspect(std::string_view name, SteadyClock::time_point deadline);
  // The names starting with `prefix` ("" for every name) whose queues have holders or waiters,
  // at most `max_names` of them (1 to 10,000), each with its holder and waiter counts. A backend
  // looks at no more than 10,000 candidate names per listing (then `truncated` says so); the
  // whole listing ends by `deadline` (else BackendUnavailable). PermitCounter values are not
  // listed (inspect one by its name). Throws InvalidArgument for a prefix that no name could
  // start with (control characters, over 255 bytes) or a max_names out of range.
  NamesInUse names_in_use(std::string_view prefix, std::size_t max_names, SteadyClock::time_point deadline);

  // Removes the entry a release_receipt() (of a Mutex, SharedMutex or Lease) names, if it is
  // still there, and nothing else: for a process that outlives a holder killed without its
  // release (SIGKILL). True when the entry was there; calling it again removes nothing (its
  // answer may repeat the first one's: Redis remembers it). The holder must be gone: its hold
  // is not told. Gives up at `deadline` (BackendUnavailable); InvalidArgument when it is not
  // a receipt of this client's backend; "" (file://) removes nothing.
  bool release_receipt(std::string_view receipt, SteadyClock::time_point deadline);

  // Removes what the backend keeps for names starting with `prefix` ("" for all) that nobody
  // holds, waits for or keeps a PermitCounter value in, and returns what it removed (the names,
  // and leftovers described in parentheses). A name in use is never removed. On file:// a name's
  // state file is removed by the last process using it as it closes the name; this removes what
  // crashed processes and earlier versions left (a file an older version wrote since boot is
  // kept: a process of that version may use it). Network backends keep nothing once sessions
  // end: it returns nothing there. Throws BackendUnavailable, AccessDenied.
  std::vector<std::string> collect_unused(std::string_view prefix = {});

  void set_error_handler(ErrorHandler handler);

  // A snapshot of this client's counters and histograms (turnstile/metrics.hpp), labelled with
  // the backend and primitive (and the name, with ClientOptions::metrics_name_label).
  Metrics metrics() const;

  // Whether this backend can keep a lock hold (or, with `semaphore_lease`, a Semaphore lease)
  // after its release (release_after, --hold-at-least): file://, redis and etcd can keep both,
  // consul:// lock holds only; elsewhere release_after throws InvalidArgument.
  bool can_release_after(bool semaphore_lease = false) const;

 private:
  explicit Client(std::shared_ptr<detail::ClientState> state);  // made by connect()

  std::shared_ptr<detail::ClientState> state_;
};

}  // namespace turnstile
