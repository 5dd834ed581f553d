// The narrow interface every backend implements. The core (src/core) owns reentrancy, guards,
// MultiLock, loss signalling and release retries; a backend owns only queues and counters.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "core/loss_signal.hpp"
#include "core/queue.hpp"
#include "core/queue_store.hpp"
#include "core/url.hpp"
#include "turnstile/client.hpp"
#include "turnstile/deadline.hpp"

namespace turnstile::detail {

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

// A backend is storage for the core's queue algorithm (queue_store.hpp) plus the PermitCounter's
// plain operations and inspection.
class Backend : public QueueStore, public CounterStore {
 public:
  ~Backend() override = default;

  // Its calls end by `deadline` when one is given (else by the backend's own call bounds).
  virtual Inspection inspect(const std::string& name, Deadline deadline) = 0;

  // PermitCounter: a number changed atomically; its waiters are served by the core's loop.
  virtual bool counter_try_set(const std::string& name, std::int64_t permits) = 0;
  virtual std::int64_t counter_add(const std::string& name, std::int64_t delta) = 0;
  virtual std::optional<std::int64_t> counter_get(const std::string& name) = 0;
  virtual std::int64_t counter_drain(const std::string& name) = 0;
};

using BackendFactory = std::unique_ptr<Backend> (*)(const BackendUrl& url, const ClientOptions& options);

// Throws InvalidArgument unless `name` is a valid turnstile name (see Client).
void validate_name(std::string_view name);

}  // namespace turnstile::detail
