// What a Client shares with every primitive it made: the backend, the error handler, the
// per-name lock tables, and the background retrier of releases that failed.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/backend.hpp"
#include "turnstile/lock.hpp"

namespace turnstile::detail {

class ClientState;

// One backend hold plus its loss signal: what a Lease or a thread's lock hold owns.
class HoldRecord {
 public:
  HoldRecord(std::shared_ptr<ClientState> client, std::string name, std::int64_t permits,
             std::unique_ptr<BackendHold> hold, std::shared_ptr<LossSignal> loss);
  ~HoldRecord();  // releases if still held, reporting failures to the error handler

  const std::string& name() const { return name_; }
  std::int64_t permits() const { return permits_; }
  // Made by this process, not inherited across fork() (see fork_generation.hpp).
  bool owned_by_this_process() const;
  std::uint64_t fencing_token() const { return token_; }
  std::stop_token lost_token() const { return loss_->token(); }
  HoldState hold_state() const { return loss_->observed_state(); }
  bool released() const { return hold_ == nullptr; }
  // Tells the holder its hold may be gone (final).
  void lose(const std::string& reason) noexcept { loss_->lose(reason); }
  std::string loss_reason() const { return loss_->reason(); }
  BackendHold& backend_hold() { return *hold_; }
  // Leaves the queue. Throws NotHeld when already released, BackendUnavailable (the release
  // then goes on in the background), HoldLost when the hold may have been lost while held.
  void release();

 private:
  std::shared_ptr<ClientState> client_;
  std::string name_;
  std::int64_t permits_;
  std::uint64_t token_;
  std::unique_ptr<BackendHold> hold_;
  std::shared_ptr<LossSignal> loss_;
  std::uint64_t fork_generation_;
};

// The per-thread hold table of one lock name within one client.
class LockCore {
 public:
  LockCore(std::shared_ptr<ClientState> client, std::string name)
      : client_(std::move(client)), name_(std::move(name)) {}

  bool acquire_exclusive(LockFlavor flavor, Deadline deadline, std::stop_token stop = {});
  void release_exclusive();
  bool acquire_shared(Deadline deadline, std::stop_token stop = {});
  void release_shared();
  bool owns_exclusive() const;
  bool owns_shared() const;
  std::uint64_t fencing_token() const;
  std::stop_token lost_token() const;
  HoldState hold_state() const;
  const std::string& name() const { return name_; }
  ClientState& client() { return *client_; }

 private:
  struct ThreadHold {
    std::unique_ptr<HoldRecord> record;  // one backend entry per thread and name
    LockFlavor exclusive_flavor = LockFlavor::plain;
    int exclusive_count = 0;
    int shared_count = 0;  // when exclusive_count > 0 too, the reads ride on the write entry
  };
  // A handful of threads at most hold one name at once: a linear scan of a vector that keeps
  // its capacity costs no allocation per acquire, unlike a hash map node.
  using Holds = std::vector<std::pair<std::thread::id, ThreadHold>>;
  // The calling thread's hold, skipping those a forked child inherited from its parent (its
  // thread id may equal the parent's thread's, but the hold is not the child's).
  Holds::iterator find_mine();
  const ThreadHold* find_current() const;
  // The calling thread's hold; throws NotHeld.
  const HoldRecord& current_record() const;
  void erase(Holds::iterator it);
  // Throws HoldLost when `record` may have been lost (before a nested acquire counts on it).
  void throw_if_lost(const HoldRecord& record) const;

  std::shared_ptr<ClientState> client_;
  std::string name_;
  mutable std::mutex mutex_;
  Holds holds_;
};

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
  std::shared_ptr<LockCore> lock_core(const std::string& name);
  // Takes over a hold whose release failed and retries it with backoff until it succeeds.
  void retry_release_later(std::string name, std::unique_ptr<BackendHold> hold);
  // Acquires through the backend and wraps the result; nullptr on timeout or a requested stop.
  std::unique_ptr<HoldRecord> acquire(const QueueRequest& request, Deadline deadline);

 private:
  void retry_loop(std::stop_token stop);

  std::string url_;
  std::unique_ptr<Backend> backend_;
  bool usable_after_fork_;
  std::uint64_t fork_generation_;  // when connected
  ClientOptions options_;
  std::mutex handler_mutex_;
  ErrorHandler error_handler_;
  std::shared_ptr<const LossSignal::Callbacks> hold_callbacks_;  // shared by every LossSignal, not copied

  std::mutex cores_mutex_;
  std::unordered_map<std::string, std::weak_ptr<LockCore>> cores_;

  struct PendingRelease {
    std::string name;
    std::unique_ptr<BackendHold> hold;
    std::chrono::milliseconds backoff;
    SteadyClock::time_point next_try;
    std::uint64_t fork_generation;  // a child never retries its parent's releases
  };
  std::mutex retry_mutex_;
  std::condition_variable_any retry_cv_;
  std::deque<PendingRelease> pending_;
  std::uint64_t retrier_generation_ = 0;
  std::jthread retrier_;  // started on the first failed release; last member: joined first
};

}  // namespace turnstile::detail
