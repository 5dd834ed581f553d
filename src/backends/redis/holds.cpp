// A hold of the Redis backend: its downgrade and its release.
#include "backends/redis/redis_backend.hpp"
#include "backends/redis/scripts.hpp"

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
  if (integer_of(reply) == 0) lease_->lose("its entry expired or the redis server forgot it");
}

void RedisHold::release() {
  if (released_) return;
  const auto keys = backend_.keys_of(name_);
  // Bounded: at most kRedisTimes.release_try, and no longer once the hold is reported lost (a hold
  // already lost gets one short try): the caller must hear of a loss at once, and the core
  // retries a failed release in the background. A resend after a lost reply finds the release
  // remembered, not a loss.
  const bool lost = loss_->lost_by_now();
  const auto patience = lost ? kLostReleasePatience : kRedisTimes.release_try;
  // From now on a renewal that finds the entry gone may have crossed this release: only the
  // release's own answer says whether the hold was lost.
  state_->releasing = true;
  auto& ids = backend_.request_ids();
  if (release_request_ == 0) release_request_ = ids.open(keys.keys.back());
  auto reply = backend_.connection().eval(
      scripts::release, keys.keys,
      {keys.channel, std::to_string(seq_), request_, backend_.release_memory_ms(),
       ids.marked(keys.keys.back(), release_request_)},
      {.budget = {SteadyClock::now() + patience, lost ? std::stop_token() : loss_->token()}, .idempotent = true});
  ids.settle(keys.keys.back(), std::exchange(release_request_, 0));
  released_ = true;
  backend_.untrack(this);
  if (integer_of(reply) == 0) {
    lease_->lose("its entry had expired or the redis server forgot it before the release");
  } else {
    lease_->detach(loss_.get());
  }
}
}  // namespace turnstile::detail::redis
