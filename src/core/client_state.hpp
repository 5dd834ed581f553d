// What a Client shares with every primitive it made: the backend, the error handler, the
// per-name thread-hold tables, and the background removal of holds whose release failed.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "core/backend.hpp"
#include "core/guaranteed_removal.hpp"
#include "core/hold_record.hpp"
#include "core/thread_holds.hpp"

namespace turnstile::detail {

class ClientState : public std::enable_shared_from_this<ClientState> {
 public:
  // `usable_after_fork`: the backend works in a forked child (the embedded one does); else
  // every call in a child throws BackendUnavailable and the child's copy is never torn down.
  ClientState(std::string url, std::unique_ptr<Backend> backend, ClientOptions options, bool usable_after_fork);
  ~ClientState();

  const std::string& url() const { return url_; }
  // Throws BackendUnavailable in a forked child when the backend does not survive fork.
  Backend& backend();
  void report(const Error& error) noexcept;
  void set_error_handler(ErrorHandler handler);
  std::shared_ptr<LossSignal> new_loss_signal(const std::string& name);
  // The table of the threads' holds of lock `name` (one per name while any lock handle lives).
  std::shared_ptr<ThreadHolds> thread_holds(const std::string& name);
  // Takes over a hold whose release failed and retries it in the background until it succeeds,
  // fails for good (reported), or the client ends.
  void retry_release_later(std::string name, std::unique_ptr<BackendHold> hold);
  // Acquires through the backend and wraps the result; nullptr on timeout or a requested stop.
  std::unique_ptr<HoldRecord> acquire(const QueueRequest& request, Deadline deadline);

 private:
  std::string url_;
  std::unique_ptr<Backend> backend_;
  bool usable_after_fork_;
  std::uint64_t fork_generation_;  // when connected
  ClientOptions options_;
  std::mutex handler_mutex_;
  ErrorHandler error_handler_;
  std::shared_ptr<const LossSignal::Callbacks> hold_callbacks_;  // shared by every LossSignal, not copied

  std::mutex holds_mutex_;
  std::unordered_map<std::string, std::weak_ptr<ThreadHolds>> thread_holds_;

  // After backend_ (its attempts use the backend) and the handler (it reports): destroyed first.
  GuaranteedRemoval releases_;
};

}  // namespace turnstile::detail
