// The narrow interface every backend implements. The core (src/core) owns reentrancy, guards,
// MultiLock, loss signalling and release retries; a backend owns only queues and counters.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <vector>

#include "turnstile/client.hpp"
#include "turnstile/deadline.hpp"

namespace turnstile::detail {

enum class EntryKind : std::uint8_t { exclusive = 1, shared = 2, lease = 3 };

const char* to_string(EntryKind kind);

// One contender joining a name's queue.
struct QueueRequest {
  std::string name;
  EntryKind kind = EntryKind::exclusive;
  std::int64_t permits = 1;  // leases only
  std::int64_t limit = 0;    // leases only: the Semaphore's limit
  // Asked through a SharedMutex (a writer or a reader) rather than a Mutex: same queue, but
  // peers like Curator name a read/write lock's nodes differently.
  bool shared_mutex = false;
  // Requested by the caller (a signal in the CLI, a shutting-down service): the waiter leaves
  // the queue and acquire returns nullptr, as on a deadline. Backends wake on it while waiting.
  std::stop_token stop;
};

// How a hold learns its state: lost (final; a stop_source the holder's stop_token watches) or
// suspended (the backend cannot confirm it now, but it may be alive), plus the client's
// callbacks. Backends call lose(), suspend() and resume(); each is idempotent, and the last two
// do nothing once lost. Made on every acquire, so it is cheap: the stop state is allocated
// only when someone asks for a token, and the callbacks are shared with the client.
class LossSignal {
 public:
  struct Callbacks {
    ErrorHandler on_lost;
    HoldStateHandler on_state;
  };
  LossSignal(std::string name, std::shared_ptr<const Callbacks> callbacks)
      : name_(std::move(name)), callbacks_(std::move(callbacks)) {}
  void lose(const std::string& reason, std::chrono::milliseconds margin = std::chrono::milliseconds(0)) noexcept;
  // lose() in two steps, so that many holds can all be marked lost before any one's callbacks
  // run (a slow callback must not delay another hold's report): mark_lost() changes the state
  // (false when it was lost already), tell_lost() signals the token and calls the callbacks.
  // `margin`: how long before the server could hand the hold to someone else (0: it may have).
  bool mark_lost(const std::string& reason, std::chrono::milliseconds margin) noexcept;
  void tell_lost() noexcept;
  void suspend(const std::string& reason) noexcept;
  void resume() noexcept;
  HoldState state() const noexcept { return state_.load(std::memory_order_acquire); }
  bool lost() const noexcept { return state() == HoldState::lost; }
  std::string reason() const;  // why it was lost
  std::stop_token token() const;
  // Called once the hold exists, while the backend's watcher may already be calling lose().
  void set_fencing_token(std::uint64_t token) { fencing_token_.store(token, std::memory_order_relaxed); }

 private:
  // Moves to `next` unless lost; false when nothing changed.
  bool change_state(HoldState next) noexcept;
  void tell(HoldState state, const std::string& reason, std::chrono::milliseconds margin = {}) noexcept;

  std::string name_;
  std::shared_ptr<const Callbacks> callbacks_;
  std::atomic<std::uint64_t> fencing_token_{0};
  std::atomic<HoldState> state_{HoldState::held};
  mutable std::mutex mutex_;
  mutable std::stop_source source_{std::nostopstate};  // made by the first token()
  std::string reason_;
  std::chrono::milliseconds margin_{0};
  // Held from a change through its callbacks, so a hold's changes are told in order.
  // Recursive: a callback may release the hold, and the release may find it lost.
  std::recursive_mutex tell_mutex_;
};

// One admitted entry of a queue.
class BackendHold {
 public:
  virtual ~BackendHold() = default;
  virtual std::uint64_t fencing_token() const = 0;
  // An exclusive entry becomes a shared one in place: same position, same token.
  virtual void downgrade() = 0;
  // Leaves the queue. Throws BackendUnavailable (the core retries later) or HoldLost.
  // Once it has succeeded, calling it again does nothing.
  virtual void release() = 0;
};

// A parsed backend URL: scheme://[user[:password]@]host:port[,host:port...][/path][?k=v&...]
struct BackendUrl {
  std::string text;  // as written, but with credentials replaced by *** (safe for messages)
  std::string scheme;
  std::string user;
  std::string password;
  std::vector<std::string> hosts;  // "host:port" as written
  std::string path;                // percent-decoded, starts with '/' when present
  std::map<std::string, std::string> query;
};

// Throws InvalidUrl naming what is wrong (with credentials redacted).
BackendUrl parse_url(std::string_view text);

// A URL as it may be shown: the password of user:password@, a userinfo that is a token alone
// (consul://TOKEN@host), and the values of secret-looking query parameters become ***.
// Works on malformed URLs too, so no message ever carries a credential.
std::string redact_url(std::string_view text);

// One "host[:port]" of a URL's host list, the port checked (1 to 65535); `default_port` when
// none is written (0: a port is required). Throws InvalidUrl naming the URL.
struct HostPort {
  std::string host;
  int port = 0;
};
HostPort parse_host_port(const std::string& text, int default_port, const BackendUrl& url);

// A query parameter given in (possibly fractional) seconds, between `min` and `max` seconds.
// Throws InvalidUrl naming the parameter.
std::chrono::milliseconds parse_seconds(const std::string& parameter, const std::string& value, double min, double max);

class Backend {
 public:
  virtual ~Backend() = default;

  // Joins the queue and waits until admitted (nullptr when the deadline passes first; the
  // entry has then left). Throws KindMismatch, LimitMismatch, QueueFull, BackendUnavailable.
  virtual std::unique_ptr<BackendHold> acquire(const QueueRequest& request, Deadline deadline,
                                               std::shared_ptr<LossSignal> loss) = 0;
  virtual Inspection inspect(const std::string& name) = 0;

  // PermitCounter: a number changed atomically, waiters served in arrival order.
  virtual bool counter_try_set(const std::string& name, std::int64_t permits) = 0;
  virtual std::int64_t counter_add(const std::string& name, std::int64_t delta) = 0;
  virtual std::optional<std::int64_t> counter_get(const std::string& name) = 0;
  virtual std::int64_t counter_drain(const std::string& name) = 0;
  virtual bool counter_acquire(const std::string& name, std::int64_t permits, Deadline deadline) = 0;
};

using BackendFactory = std::unique_ptr<Backend> (*)(const BackendUrl& url, const ClientOptions& options);

// Where a contender stands in a queue, backend-neutral (the Curator insight: one queue
// algorithm, a predicate per primitive).
struct QueueEntryView {
  EntryKind kind;
  std::int64_t permits;
};

enum class WaitFor {
  nothing,          // admitted
  leave,            // the entry at `index` leaving (or dying)
  exclusive_end,    // the entry at `index` leaving or downgrading to shared
  admission,        // the entry at `index` being admitted (or leaving)
  any_holder_leave, // any entry ahead leaving: every one ahead holds, none is enough alone
};

struct Verdict {
  WaitFor wait = WaitFor::nothing;
  std::size_t index = 0;
  bool admitted() const { return wait == WaitFor::nothing; }
};

// entries[0..mine] are the live entries up to and including ours, in queue order.
Verdict evaluate_queue(const std::vector<QueueEntryView>& entries, std::size_t mine, std::int64_t limit);

// Checks a request against a queue that already has `mode` ("lock"/"semaphore"/"") and limit.
// Throws KindMismatch or LimitMismatch.
void check_queue_mode(const QueueRequest& request, const std::string& mode, std::int64_t limit);

// Throws InvalidArgument unless `name` is a valid turnstile name (see Client).
void validate_name(std::string_view name);

}  // namespace turnstile::detail
