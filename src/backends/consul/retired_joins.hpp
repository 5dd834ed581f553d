// SPDX-License-Identifier: Apache-2.0
// Markers of ended joins (retired_joins.cpp). A copy of a join's transaction can reach Consul
// after its acquire ended (libcurl resends a request on a reused connection that died; a
// request held up on the way): it would add the entry again under the client's live session, a
// waiter nobody owns. Every join checks that its marker turnstile/x/<id> is absent, and every
// ending of an entry writes that marker (locked by the main session, so it goes with it) in the
// same transaction that removes the entry: a release, a leave, a release_after, a given-up join
// (given_up.hpp). A late copy then finds the marker and changes nothing.
//
// Every transaction that may have written a marker hands it over here, whatever came back (a
// reply lost may have been applied; deleting a marker that is not there changes nothing). Each
// is deleted kRetiredKeep after it was handed over, by a sweep on the background-removal
// service's thread (its timer: an idle client is swept too): turns of at most
// kRetiredBatchesPerTurn transactions of kRetiredBatch deletes, kRetiredTurnPause apart while
// due markers remain. The bound: a client holds the markers of the joins that ended in the
// last kRetiredKeep, plus those due since the last turn, as long as its endings come slower
// than a turn's deletes per pause (thousands a second). While Consul does not answer, the
// service's pauses apply (up to 2 s) and the due markers wait; given up after its bound, the
// sweep starts again at the next ending or join. A copy delivered later than kRetiredKeep
// could still add an entry; it is held by the client's session, and goes with it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/call_budget.hpp"
#include "core/guaranteed_removal.hpp"

namespace turnstile::detail::consul {

class ConsulBackend;

// As long as Redis keeps its at-most-once request records for a client.
inline constexpr std::chrono::milliseconds kRetiredKeep{120000};
// Consul refuses a transaction of more than 64 operations.
inline constexpr std::size_t kRetiredBatch = 64;
// A turn of the sweep: then the service's other removals get their turn.
inline constexpr std::size_t kRetiredBatchesPerTurn = 8;
// Between two turns while due markers remain: never a hot loop.
inline constexpr std::chrono::milliseconds kRetiredTurnPause{50};

// The marker of the join that wrote `entry_key` (<queue>/<id>): turnstile/x/<id>.
std::string retired_marker_of(const std::string& entry_key);
// The transaction operation that writes it, on `session_id` (the entry's, the client's main one).
nlohmann::json retire_op(const std::string& entry_key, const std::string& session_id);

class RetiredJoins {
 public:
  // Keeps markers kRetiredKeep; the test suites set TURNSTILE_TEST_CONSUL_MARKER_KEEP_MS (read
  // when the client connects) to see a sweep within seconds.
  RetiredJoins();
  // `marker` may have been written now: deleted once kept (a sweep is scheduled if none is).
  void add(ConsulBackend& backend, std::string marker);
  // Schedules a sweep when markers wait and none is scheduled (one given up after an outage).
  void sweep_due(ConsulBackend& backend);

 private:
  struct Retired {
    std::string marker;
    SteadyClock::time_point at;
  };
  struct Turn {
    std::uint64_t id = 0;  // 0: none to schedule
    SteadyClock::time_point at;
  };
  // The next turn, when markers wait and none is scheduled (or `after_turn`: the turn ending).
  Turn plan_locked(bool after_turn);
  void schedule(ConsulBackend& backend, Turn turn);
  Removal sweep_turn(ConsulBackend& backend, const CallBudget& budget);
  std::vector<std::string> take_due_batch();
  void put_back(std::vector<std::string> markers);

  std::chrono::milliseconds keep_;
  std::mutex mutex_;
  std::deque<Retired> retired_;  // oldest first
  bool scheduled_ = false;       // a turn is with the background
  std::uint64_t turn_ = 0;       // the scheduled turn's id
};

// Hands `marker` over to the backend's RetiredJoins when it goes out of scope, however the transaction that may
// have written it ended (answered, refused, no reply).
class MarkerHandOver {
 public:
  MarkerHandOver(ConsulBackend& backend, std::string marker) : backend_(backend), marker_(std::move(marker)) {}
  ~MarkerHandOver();
  MarkerHandOver(const MarkerHandOver&) = delete;
  MarkerHandOver& operator=(const MarkerHandOver&) = delete;

 private:
  ConsulBackend& backend_;
  std::string marker_;
};

}  // namespace turnstile::detail::consul
