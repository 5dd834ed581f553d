// The holds the threads of one process have on one lock name, through one client: reentrancy
// (a RecursiveMutex counts, a Mutex refuses), reader/writer rules and downgrade, on top of one
// backend entry per thread.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <stop_token>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/hold_record.hpp"
#include "turnstile/lock.hpp"

namespace turnstile::detail {

class ClientState;

class ThreadHolds {
 public:
  ThreadHolds(std::shared_ptr<ClientState> client, std::string name)
      : client_(std::move(client)), name_(std::move(name)) {}

  // `primitive`: the lock type asking (Mutex refuses a nested acquire, the others count it).
  bool acquire_exclusive(Primitive primitive, Deadline deadline, std::stop_token stop = {});
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
    Primitive exclusive_primitive;
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
  // A nested exclusive acquire on the calling thread's hold `held`: counted, or refused.
  void count_nested_exclusive(ThreadHold& held, Primitive primitive);
  // The last write count of a hold that still has reads: its entry becomes a shared one.
  void downgrade_unlocked(HoldRecord& record);

  std::shared_ptr<ClientState> client_;
  std::string name_;
  mutable std::mutex mutex_;
  Holds holds_;
};

}  // namespace turnstile::detail
