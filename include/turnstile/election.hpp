// SPDX-License-Identifier: Apache-2.0
// Election: leader election on a name's queue (Curator LeaderLatch, etcd concurrency.Election,
// Consul's session-acquired leader key). Candidates queue in arrival order; the first leads,
// with a value (its proposal: who it is, where to reach it) that anyone may read.
//
// Leadership is a hold, as a Lease is: it belongs to the Election object (any thread may use
// and resign it), has a fencing token strictly greater than every earlier leader's of the name,
// and is told of its loss through hold_state(), lost_token() and ClientOptions::on_hold_state,
// by the same loss rule as a lock's (at least max(TTL/10, 50 ms) before another candidate can
// lead). `suspended` means: act as not leader until held again or lost.
//
// One name is never both an election and a lock or a Semaphore: either way round, the second
// use throws KindMismatch. Backends: docs/guide.md "Leader election" lists those with an
// election layout; elsewhere Client::election throws InvalidArgument naming the backend.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>

#include "turnstile/async.hpp"
#include "turnstile/client.hpp"
#include "turnstile/deadline.hpp"
#include "turnstile/error.hpp"

namespace turnstile {

namespace detail {
class ClientState;
class ElectionState;
class LeaderWatch;
}  // namespace detail

// The largest leader value (campaign, proclaim) in bytes. Values are bytes; peers of other
// ecosystems read them as UTF-8 text (Curator's participant id, etcdctl's output).
inline constexpr std::size_t max_election_value = 64 * 1024;

// The leader of a name, as leader() and observe() report it.
struct Leader {
  std::string value;
  std::uint64_t fencing_token = 0;  // the leader's entry's token
  // Since when it has been a candidate (its entry's creation), where the backend records it.
  std::optional<std::chrono::system_clock::time_point> since{};
  bool ours = false;  // the Election object that asked leads (leader() only)
};

// Leader changes of one name, pulled one at a time (Election::observe()). Movable, not copyable;
// one thread at a time.
class LeaderObserver {
 public:
  LeaderObserver(LeaderObserver&&) noexcept;
  LeaderObserver& operator=(LeaderObserver&&) noexcept;
  ~LeaderObserver();

  // The current leader first (or an empty optional<Leader>: nobody leads), then, call by call,
  // each change of leader or of its value as it is seen: intermediate ones may be skipped (as
  // etcd's Observe does), the latest is always reported. nullopt when `deadline` passes or
  // `stop` is requested first. Throws BackendUnavailable when the server cannot be read.
  std::optional<std::optional<Leader>> next(Deadline deadline = std::nullopt, std::stop_token stop = {});

 private:
  friend class Election;
  LeaderObserver(std::shared_ptr<detail::ClientState> client, std::string name);

  std::shared_ptr<detail::ClientState> client_;
  std::string name_;
  std::unique_ptr<detail::LeaderWatch> watch_;
  bool reported_ = false;       // the first next() has answered
  std::optional<Leader> last_;  // what it reported last
};

class Election {
 public:
  Election(Election&&) noexcept;
  Election& operator=(Election&&) noexcept;  // resigns what this object led first
  Election(const Election&) = delete;
  Election& operator=(const Election&) = delete;
  // Resigns (failures go to the client's error handler and are retried in the background).
  ~Election();

  // Joins the candidates with `value` and waits until this object leads. All of these throw
  // InvalidArgument (a value over max_election_value bytes: nothing is sent), WouldDeadlock
  // (this object is a candidate or leads already), KindMismatch (the name is in use as a lock
  // or a Semaphore), BackendUnavailable, QueueFull.
  void campaign(std::string_view value) { campaign_until(value, std::nullopt); }
  // Leads (true), or not by `timeout` or on `stop` (false, after leaving the candidates).
  // Also InvalidArgument on a negative timeout.
  template <class Rep, class Period>
  bool campaign_for(std::string_view value, const std::chrono::duration<Rep, Period>& timeout,
                    std::stop_token stop = {}) {
    return campaign_until(value, detail::deadline_after(timeout), std::move(stop));
  }
  bool campaign_until(std::string_view value, Deadline deadline, std::stop_token stop = {});
  // campaign() without a thread (turnstile/async.hpp): ends with true once this object leads,
  // false at the options' deadline or stop or on cancel() (after leaving the candidates). Throws
  // InvalidArgument and WouldDeadlock at once; the other errors end the Acquiring.
  Acquiring<bool> campaign_async(std::string value, AsyncOptions options = {});

  // Gives up leadership (the next candidate leads), or the candidacy of a campaign_async in
  // progress; nothing when neither. Throws BackendUnavailable (the resignation goes on in the
  // background) and HoldLost (leadership may have been lost before it was resigned).
  void resign();
  // Changes this leader's value in place (same fencing token). Throws NotHeld (not leading),
  // HoldLost (leadership may have been lost: nothing changed), InvalidArgument (too long),
  // BackendUnavailable (outcome unknown: the value may or may not have changed, even after the
  // throw, when a copy already on its way arrives; such a copy is applied at most once and never
  // overwrites a later proclaim).
  void proclaim(std::string_view value);

  // Whether this object leads and its leadership is confirmed (held, not suspended or lost).
  bool is_leader() const;
  // This object's leadership as a hold: NotHeld when it does not lead.
  HoldState hold_state() const;
  std::stop_token lost_token() const;   // throws NotHeld when it does not lead
  std::uint64_t fencing_token() const;  // throws NotHeld when it does not lead
  // See LockHandle::release_receipt(): removes the leader's entry from another process (one that
  // outlives a leader killed with SIGKILL). Throws NotHeld when it does not lead.
  std::string release_receipt() const;

  // The name's leader (whoever it is) by one read, or nullopt when nobody leads. Throws
  // BackendUnavailable when the server does not answer within `timeout`.
  std::optional<Leader> leader(std::chrono::milliseconds timeout = std::chrono::seconds(5)) const;
  // The name's leader changes from now on (see LeaderObserver).
  LeaderObserver observe() const;

  const std::string& name() const;

 private:
  friend class Client;  // made by Client::election()
  Election(std::shared_ptr<detail::ClientState> client, std::string name);

  std::shared_ptr<detail::ElectionState> state_;
};

}  // namespace turnstile
