// The one queue algorithm's loops, over any backend's storage (queue_store.hpp).
#include "core/backend.hpp"
#include "core/call_budget.hpp"
#include "core/queue_store.hpp"
#include "core/race_pacer.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail {
namespace {

// Leaves the queue (or the counter's line) unless the acquire ended with our entry kept.
template <typename Place>
struct LeaveUnlessKept {
  Place* place;
  ~LeaveUnlessKept() {
    if (place) place->leave();
  }
};

}  // namespace

QueueStep next_queue_step(const QueueRequest& request, const Standing& standing, bool may_wait) {
  check_queue_mode(request, standing.mode, standing.limit);
  const Verdict verdict = standing.decided
                              ? *standing.decided
                              : evaluate_queue(standing.entries, standing.entries.size() - 1, request.limit);
  if (verdict.admitted()) return {QueueStep::Action::hold, verdict};
  if (!may_wait) return {QueueStep::Action::give_up, verdict};
  return {QueueStep::Action::wait, verdict};
}

std::unique_ptr<BackendHold> acquire_in_queue(QueueStore& store, const QueueRequest& request, Deadline deadline,
                                              std::shared_ptr<LossSignal> loss) {
  const bool try_once = passed(deadline);
  const auto may_wait = [&] { return !try_once && !passed(deadline) && !request.stop.stop_requested(); };
  RacePacer races({deadline, request.stop}, try_once);
  // Each round joins at the back; a round ends when our entry vanished without our leaving
  // (nothing was held: join again, as Curator does) or the admission excluded nobody.
  for (;;) {
    if (request.stop.stop_requested()) return nullptr;
    try {
      Standing standing;
      auto place = store.join(request, try_once, deadline, standing);
      if (!place) return nullptr;
      LeaveUnlessKept<QueuePlace> leave_unless_kept{place.get()};
      for (;;) {
        const auto step = next_queue_step(request, standing, may_wait());
        if (step.action == QueueStep::Action::hold) {
          std::unique_ptr<BackendHold> hold;
          try {
            hold = place->hold(loss);
          } catch (const QueueChanged&) {
            if (!races.next()) return nullptr;  // leaves
            standing = place->look(deadline);   // still in line: decide again
            continue;
          }
          if (hold) {
            leave_unless_kept.place = nullptr;  // the hold owns the entry now
            return hold;
          }
          break;  // the entry has left: join again
        }
        if (step.action == QueueStep::Action::give_up) return nullptr;
        // The entries are not kept while we sleep: a waiter's memory stays constant however long
        // the queue ahead (the next look reads them again).
        std::vector<QueueEntryView>().swap(standing.entries);
        place->wait(step.verdict, deadline, request.stop);
        // A deadline or stop that ended the wait ends the acquire: no look past the deadline.
        if (!may_wait()) return nullptr;
        standing = place->look(deadline);
      }
    } catch (const QueueEntryGone&) {
      if (try_once || passed(deadline) || !races.next()) return nullptr;
    }
  }
}

bool acquire_from_counter(CounterStore& store, const std::string& name, std::int64_t permits, Deadline deadline,
                          const std::stop_token& stop) {
  const bool try_once = passed(deadline);
  const auto last_try = [&] { return try_once || passed(deadline) || stop.stop_requested(); };
  RacePacer races({deadline, stop}, try_once);
  for (;;) {
    auto line = store.counter_line(name, permits, stop);
    LeaveUnlessKept<CounterLine> leave_unless_kept{line.get()};
    try {
      for (;;) {
        const bool last = last_try();
        const auto standing = line->look(last, deadline);
        if (standing.taken) {
          leave_unless_kept.place = nullptr;
          return true;
        }
        const auto wait = evaluate_counter_line(standing.ahead, standing.value, permits);
        if (wait == CounterWait::nothing) {
          if (line->take(standing, deadline)) {
            leave_unless_kept.place = nullptr;
            return true;
          }
          if (!races.next()) return false;  // leaves the line
          continue;                         // changed meanwhile: look again
        }
        if (last) return false;
        if (!standing.in_line) {
          line->join(deadline);
          continue;  // look again from our place
        }
        line->wait(wait, deadline, stop);
        // A deadline or stop that ended the wait ends the acquire: no look past the deadline
        // (a look to a server that does not answer would hold the stop up).
        if (passed(deadline) || stop.stop_requested()) return false;
      }
    } catch (const QueueEntryGone&) {
      if (last_try() || !races.next()) return false;
    } catch (const BackendUnavailable&) {
      // A lost reply may have taken the permits: the storage says so when we leave.
      leave_unless_kept.place = nullptr;
      if (line->leave()) return true;
      throw;
    }
  }
}

}  // namespace turnstile::detail
