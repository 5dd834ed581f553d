// SPDX-License-Identifier: Apache-2.0
// A hold of the Redis backend: its downgrade and its release.
#include <tuple>

#include "backends/redis/redis_backend.hpp"
#include "backends/redis/scripts.hpp"
#include "core/backend.hpp"
#include "core/receipt.hpp"

namespace turnstile::detail::redis {

RedisHold::RedisHold(RedisBackend& backend, std::string name, std::uint64_t seq, std::uint64_t join,
                     std::shared_ptr<LossSignal> loss, std::shared_ptr<ServerLease> lease, std::string server)
    : backend_(backend), name_(std::move(name)), seq_(seq), server_(std::move(server)),
      request_(backend.request_ids().id(join)), loss_(std::move(loss)), lease_(std::move(lease)),
      state_(std::make_shared<HoldLease>(lease_)) {
  lease_->attach(loss_);
  backend_.track(this);
}

RedisHold::~RedisHold() {
  // A forked child's copy of the parent's hold: the parent's threads may have held these
  // mutexes at the fork, and the entry is the parent's. Nothing is touched, nothing is sent.
  if (fork_generation_ != fork_generation()) return;
  lease_->detach(loss_.get());
  if (!released_) backend_.untrack(this);  // the core releases first; this only guards misuse
  if (release_request_ != 0) backend_.request_ids().settle(backend_.keys_of(name_).keys.back(), release_request_);
}

void RedisHold::downgrade() {
  const auto keys = backend_.keys_of(name_);
  auto reply = backend_.connection().eval(scripts::downgrade, keys.keys, {keys.channel, std::to_string(seq_), request_},
                                          {.budget = CallBudget().for_call(kRedisTimes.call), .idempotent = true});
  if (integer_of(reply) == 0) lease_->lose("its entry expired or the redis server forgot it", LossCause::entry_gone);
}

void RedisHold::proclaim(const std::string& value) {
  const auto keys = backend_.keys_of(name_);
  const auto& key = keys.keys.back();
  auto& ids = backend_.request_ids();
  const auto n = ids.open(key);
  const auto marked = ids.marked(key, n);
  const auto seq = std::to_string(seq_);
  Reply reply;
  try {
    reply = backend_.connection().eval(scripts::proclaim, keys.keys, {keys.channel, seq, request_, value, marked},
                                       {.budget = CallBudget().for_call(kRedisTimes.call), .idempotent = true});
  } catch (const BackendUnavailable& error) {
    // Its outcome is unknown: the request is retired, so a copy that arrives after the retirement
    // changes nothing; one already queued ahead of it (a paused server) may still apply, once.
    backend_.retire_later({&scripts::proclaim, keys.keys, {keys.channel, seq, request_, "", marked, "1"}, key, {n}});
    throw BackendUnavailable("the outcome of a proclaim on election '" + name_ + "' is unknown (" + error.what() +
                             "): the value may or may not have changed; a copy of it still on its way is " +
                             "applied at most once and never overwrites a later proclaim");
  } catch (...) {
    ids.settle(key, n);  // an error reply: nothing was changed
    throw;
  }
  ids.settle(key, n);
  if (integer_of(reply) != 1) {
    lease_->lose("its entry expired or the redis server forgot it (found by a proclaim)", LossCause::entry_gone);
    throw HoldLost("the leadership of '" + name_ + "' (fencing token " + std::to_string(seq_) +
                   ") was lost: its entry is gone; nothing was proclaimed");
  }
}

void RedisHold::release() { leave_keeping(milliseconds::zero()); }

void RedisHold::release_after(milliseconds keep_for) { leave_keeping(keep_for); }

std::vector<std::string> RedisHold::release_args(const QueueKeys& keys, milliseconds keep_for) {
  // From now on a renewal that finds the entry gone may have crossed this release: only the
  // release's own answer says whether the hold was lost.
  state_->releasing = true;
  auto& ids = backend_.request_ids();
  if (release_request_ == 0) release_request_ = ids.open(keys.keys.back());
  std::vector<std::string> args{keys.channel, std::to_string(seq_), request_, backend_.release_memory_ms(),
                                ids.marked(keys.keys.back(), release_request_)};
  if (keep_for > milliseconds::zero()) {
    // The entry's expiry is at least the last confirmed renewal's send time + TTL (by the
    // server's clock it ran later): the promised end, relative to it, holds however late this arrives.
    const auto renewed_expiry = lease_->loss_deadline() + lease_->margin();
    const auto past_expiry = std::chrono::ceil<milliseconds>(SteadyClock::now() + keep_for - renewed_expiry);
    args.push_back(std::to_string(keep_for.count()));
    args.push_back(std::to_string(past_expiry.count()));
  }
  return args;
}

void RedisHold::released(const Reply& reply) {
  const auto removed = integer_of(reply);  // a reply of another shape throws: the release is tried again
  backend_.request_ids().settle(backend_.keys_of(name_).keys.back(), std::exchange(release_request_, 0));
  released_ = true;
  backend_.untrack(this);
  if (removed == 0) {
    lease_->lose("its entry had expired or the redis server forgot it before the release", LossCause::entry_gone);
  } else {
    lease_->detach(loss_.get());
  }
}

void RedisHold::leave_keeping(milliseconds keep_for) {
  if (released_) return;
  const auto keys = backend_.keys_of(name_);
  // Bounded: at most kRedisTimes.release_try, and no longer once the hold is reported lost (a hold
  // already lost gets one short try): the caller must hear of a loss at once, and the core
  // retries a failed release in the background. A resend after a lost reply finds the release
  // remembered, not a loss.
  const bool lost = loss_->lost_by_now();
  const auto patience = lost ? kLostReleasePatience : kRedisTimes.release_try;
  const auto args = release_args(keys, keep_for);
  const auto reply = backend_.connection().eval(
      scripts::release, keys.keys, args,
      {.budget = {SteadyClock::now() + patience, lost ? std::stop_token() : loss_->token()}, .idempotent = true});
  released(reply);
}

void RedisHold::release_pipelined(ReleaseDone done) {
  // A hold already lost gets release()'s one short try; a forked child's copy is the core's.
  if (released_ || loss_->lost_by_now() || fork_generation_ != fork_generation()) {
    return BackendHold::release_pipelined(std::move(done));
  }
  const auto keys = backend_.keys_of(name_);
  const auto args = release_args(keys, milliseconds::zero());
  // The same release request as release() would send: a try of it after this one failed (the
  // core's retry) is a resend the script recognises.
  auto answer = [this, done](Result result) {
    auto error = result.error;
    if (!error) {
      try {
        released(result.reply);
      } catch (...) {
        error = std::current_exception();
      }
    }
    done(error);  // may destroy this hold: nothing of it is touched after
  };
  if (backend_.connection().send_pipelined(scripts::release, keys.keys, args, answer)) {
    backend_.collect_soon();
    return;
  }
  BackendHold::release_pipelined(std::move(done));  // no idle connection: release() waits
}

std::string RedisHold::receipt() const { return receipt_text({"redis1", request_, std::to_string(seq_), name_}); }

namespace {
// A release request number above any its owner's client used (they start at 1 and count one
// per request), at most 15 digits as the scripts accept: settling every request below it
// retires whatever of the dead holder's requests may still arrive.
constexpr std::uint64_t kReceiptRelease = 100'000'000'000'000;
}  // namespace

bool RedisBackend::release_receipt(const std::string& receipt, Deadline deadline) {
  const auto fields = receipt_fields(receipt, "redis1", 4);
  if (!fields) return Backend::release_receipt(receipt, deadline);
  const auto& [request, seq, name] = std::tie((*fields)[1], (*fields)[2], (*fields)[3]);
  const auto colon = request.find(':');
  if (colon == std::string::npos || seq.empty() || seq.find_first_not_of("0123456789") != std::string::npos) {
    return Backend::release_receipt(receipt, deadline);
  }
  validate_name(name);
  const auto keys = keys_of(name);
  // The release script of the holder itself, as one of its own requests (its client's prefix),
  // numbered past all of them: it removes exactly that entry and admits the next waiter.
  const auto n = std::to_string(kReceiptRelease);
  const auto marked = request.substr(0, colon) + ":" + n + ":" + std::to_string(kReceiptRelease + 1) + ":" +
                      release_memory_ms() + ":" + n;
  auto reply = connection().eval(scripts::release, keys.keys, {keys.channel, seq, request, release_memory_ms(), marked},
                                 {.budget = CallBudget(deadline).for_call(kRedisTimes.call), .idempotent = true});
  return integer_of(reply) == 1;
}

}  // namespace turnstile::detail::redis
