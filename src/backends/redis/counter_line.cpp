// SPDX-License-Identifier: Apache-2.0
#include "backends/redis/redis_backend.hpp"
#include "backends/redis/scripts.hpp"

namespace turnstile::detail::redis {

// One PermitCounter acquire. counter_acquire.lua decides in one step: it takes the permits when
// we are first in line (or the line is empty) and the count has them, else places us in line.
class RedisCounterLine final : public CounterLine {
 public:
  RedisCounterLine(RedisBackend& backend, const std::string& name, std::int64_t permits, std::stop_token stop)
      : backend_(backend), keys_(counter_keys(name, backend.settings_.cluster())), permits_(permits),
        request_(backend.request_ids_.open(keys_.keys.back())), stop_(std::move(stop)),
        listener_(backend.waiters_, backend.subscriber_, Waiters::Line::counter, keys_.channel) {}
  // The acquire's number is in flight until it is settled: taken, or left (answered), or handed
  // to the background retire.
  ~RedisCounterLine() override {
    if (!retiring_) backend_.request_ids_.settle(keys_.keys.back(), request_);
  }

  // The last try (the deadline passed, or a stop) takes or leaves the line; see run() for its time.
  CounterStanding look(bool last_try, Deadline deadline) override { return run(last_try ? "1" : "0", deadline); }
  bool take(const CounterStanding& seen, Deadline deadline) override {
    return run(seen.in_line ? "0" : "1", deadline).taken;
  }
  // A look already placed us in line; otherwise this does (a take by it shows at the next look).
  void join(Deadline deadline) override {
    if (!in_line_) run("0", deadline);
  }
  void wait(CounterWait, Deadline deadline, const std::stop_token& stop) override {
    const CallBudget budget(deadline, stop);
    if (listener_.subscribe(budget)) return;
    listener_.sleep(backend_.recheck_interval(), budget);
  }
  // The same without a thread: a message (the count changed) wakes the first in line, and the
  // watchdog's rounds stand in for the re-check (our place in line lives by our looks).
  std::unique_ptr<WakeArm> arm(CounterWait, Deadline, Wake wake) override {
    if (backend_.waiters_.recheck(listener_.waiter)) backend_.renew_soon();  // its rounds come often now
    return listener_.arm(std::move(wake));
  }
  bool leave() noexcept override {
    if (settled_) return taken_;
    try {
      taken_ = run_script("2", Deadline(SteadyClock::now() + kRedisTimes.leave_try)).taken;  // not ended by the stop
    } catch (...) {
      // Unanswered: a look of ours may still arrive, or may have taken the permits. Retired in
      // the background: a take it made is given back (we report "not taken"), our place goes,
      // and a look delivered later changes nothing.
      try {
        retiring_ = true;
        backend_.retire_later({&scripts::counter_retire,
                               keys_.keys,
                               {keys_.channel, marked(), std::to_string(permits_)},
                               keys_.keys.back(),
                               {request_}});
      } catch (...) {
      }
    }
    settled_ = true;
    return taken_;
  }

 private:
  // Every call but a leave: at least the one-shot floor (kRedisTimes), so a short deadline on a healthy server ends
  // in the script's answer; without a deadline the call cap (the line's calls are all bounded);
  // ended at once by the caller's stop. After a stop we leave (bounded) and report "not taken,
  // waiting" (the core then gives up), or taken when the leave finds that a call we cut short
  // had taken the permits.
  CounterStanding run(const char* mode, Deadline deadline) {
    if (!stop_.stop_requested()) {
      try {
        return run_script(mode, {deadline ? at_least_floor(deadline) : CallBudget().call_end(kRedisTimes.call), stop_});
      } catch (const BackendUnavailable&) {
        if (!stop_.stop_requested() && deadline) throw;
        if (!stop_.stop_requested()) {
          // No deadline: wait through an outage as a queue waiter does. Counted as still in
          // line; the next look resends with our request id, which finds our place or our take.
          CounterStanding waiting;
          waiting.in_line = in_line_ = true;
          waiting.ahead = 1;
          return waiting;
        }
      }
    }
    CounterStanding standing;
    standing.taken = leave();
    standing.in_line = !standing.taken;
    standing.ahead = standing.taken ? 0 : 1;
    return standing;
  }

  // Runs counter_acquire in `mode`: "0" take or wait in line, "1" take or leave, "2" only leave.
  // The script remembers a take by our request id, so a resend after a lost reply says taken.
  CounterStanding run_script(const char* mode, const CallBudget& budget) {
    listener_.unpoke();
    settled_ = false;  // until answered, a lost reply may have placed us or taken the permits
    auto reply = backend_.connection_.eval(
        scripts::counter_acquire, keys_.keys,
        {keys_.channel, std::to_string(permits_), std::to_string(backend_.settings_.ttl.count()), mode,
         backend_.identity_, marked(), backend_.label_suffix_},
        {.budget = budget, .idempotent = true});
    CounterStanding standing;
    const auto status = integer_at(reply.get(), 0);
    if (status == 0 || status == 1) {
      settled_ = true;
      in_line_ = false;
      standing.taken = taken_ = status == 1;
      return standing;  // not taken: out of the line, and the count was short (value unknown)
    }
    if (status != 2) throw BackendUnavailable("redis answered counter_acquire with status " + std::to_string(status));
    const auto place = token_at(reply.get(), 1);
    const auto head = token_at(reply.get(), 2);
    backend_.waiters_.set_place(keys_.channel, listener_.waiter, place);
    // The message that woke us may have been meant for the first in line: if that is one of
    // ours, it looks now rather than at its next re-check.
    if (head != place && backend_.waiters_.poke_counter_head(keys_.channel, head)) backend_.subscriber_.request_turn();
    in_line_ = standing.in_line = true;
    standing.ahead = head == place ? 0 : 1;  // the script tells first or not, not how many
    return standing;
  }

  RedisBackend& backend_;
  QueueKeys keys_;
  std::int64_t permits_;
  // The acquire's request (marked with the key's watermark at each send).
  std::string marked() { return backend_.request_ids_.marked(keys_.keys.back(), request_); }

  std::uint64_t request_;  // the same for every look: a resend finds our place or our take
  bool retiring_ = false;  // handed to the background retire, which settles it
  std::stop_token stop_;   // the caller's: every call but a leave ends on it
  Listener listener_;      // registered before the first look
  bool in_line_ = false;
  bool settled_ = true;  // known out of the line (or taken): leave() has nothing to do
  bool taken_ = false;   // what the last answer said of our take (leave() repeats it)
};

std::unique_ptr<CounterLine> RedisBackend::counter_line(const std::string& name, std::int64_t permits,
                                                        const std::stop_token& stop) {
  return std::make_unique<RedisCounterLine>(*this, name, permits, stop);
}
}  // namespace turnstile::detail::redis
