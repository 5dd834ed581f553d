// A hold of a queue entry in Consul's KV store (holds.hpp): its downgrade and its release.
#include "backends/consul/holds.hpp"

#include "backends/consul/consul_backend.hpp"
#include "backends/consul/occupancy.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail::consul {
namespace {

class ConsulHold final : public BackendHold {
 public:
  ConsulHold(ConsulBackend& backend, HoldParts parts)
      : backend_(backend), name_(std::move(parts.name)), session_(std::move(parts.session)),
        entry_key_(std::move(parts.entry_key)), value_(std::move(parts.value)), permits_(std::move(parts.permits)),
        token_(parts.token), loss_(std::move(parts.loss)), holds_key_(value_.kind == EntryKind::exclusive),
        last_in_(parts.last_in) {
    session_->lease->attach(loss_);
    for (const auto& permit : permits_) permit->lease->attach(loss_);
  }
  ~ConsulHold() override {
    if (!released_) detach();
  }

  std::uint64_t fencing_token() const override { return token_; }

  // The entry's value is rewritten in place (same key, same place, same token); the api.Lock
  // key stays ours until the release, so Consul's own clients stay out while we read. Only
  // while the entry is still ours: a late copy, delivered after the release removed the entry,
  // must not bring it back held (a plain acquire would create it).
  void downgrade() override {
    value_.kind = EntryKind::shared;
    value_.held = true;  // a reader's entry says it holds (an exclusive one's head and key do)
    const auto ops = nlohmann::json::array(
        {kv_check_session(entry_key_, session_->id), kv_lock(entry_key_, to_json(value_), 0, session_->id)});
    Refused refused;  // the entry is gone or not the session's: with its session, or released
    if (!backend_.txn(ops, kConsulTimes.release_try, "downgrading '" + name_ + "'", &refused)) {
      throw HoldLost("the write lock of '" + name_ +
                     "' was lost before its downgrade (its Consul session ended): " + refused.describe());
    }
  }

  void release() override {
    if (released_) return;
    const auto patience = loss_->lost_by_now() ? kLostReleaseTry : kConsulTimes.release_try;
    const CallBudget budget(SteadyClock::now() + patience);
    if (value_.kind == EntryKind::lease) release_permits(budget);
    else release_lock(budget.call_timeout(kConsulTimes.call));
    released_ = true;
    detach();
    for (auto& permit : permits_) backend_.sessions().give_back(std::move(permit));
    permits_.clear();
  }

 private:
  void detach() {
    session_->lease->detach(loss_.get());
    for (const auto& permit : permits_) permit->lease->detach(loss_.get());
  }

  // api.Lock's Unlock and our entry's removal in one transaction that first checks the entry is
  // still ours: a resend of a release already applied (or a release after the session ended)
  // changes nothing, so it can never unlock the key for another hold of this client's session.
  void release_lock(milliseconds timeout) {
    nlohmann::json ops = nlohmann::json::array();
    ops.push_back(kv_check_session(entry_key_, session_->id));
    if (holds_key_) ops.push_back(kv_unlock(encode_name(name_), kLockFlags, session_->id));
    ops.push_back(kv_op("delete", entry_key_));
    const auto results = finish(std::move(ops), timeout);
    if (holds_key_) {
      // The key as we left it: the next uncontended join of ours may take it in one step.
      std::optional<std::uint64_t> released;
      for (const auto& entry : results.value_or(std::vector<KvEntry>{})) {
        if (entry.key == encode_name(name_)) released = entry.modify_index;
      }
      backend_.note_released_lock(name_, released);
    }
    holds_key_ = false;
  }

  // Runs a release's transaction, with the occupancy key's removal when we were the last one in
  // (left out when someone joined since: then the rest of it is applied without it). Refused
  // otherwise: our entry is no longer ours (released already, or its session ended), and its
  // removal alone is made sure of.
  std::optional<std::vector<KvEntry>> finish(nlohmann::json ops, milliseconds timeout) {
    const auto context = "releasing '" + name_ + "'";
    if (last_in_ != 0) {
      auto op = kv_op("delete-cas", occupancy_key(name_));
      op["KV"]["Index"] = last_in_;
      ops.push_back(op);
      Refused refused;
      if (auto results = backend_.txn(ops, timeout, context, &refused)) return results;
      ops.erase(ops.size() - 1);
      // Only the occupancy's CAS lost (someone joined since): the rest goes without it.
      if (!refused.only(ops.size(), Refusal::stale)) {
        backend_.write("DELETE", "/v1/kv/" + url_escape(entry_key_), "", timeout, context);
        return std::nullopt;
      }
    }
    auto results = backend_.txn(ops, timeout, context);
    if (!results) backend_.write("DELETE", "/v1/kv/" + url_escape(entry_key_), "", timeout, context);
    // Those who joined since may all have left already (a waiter that timed out).
    end_occupancy_if_last(backend_, name_, timeout);
    return results;
  }

  // api.Semaphore's Release: our holders out of `.lock` by CAS (deleted when none is left),
  // the contender keys and our entry, in one transaction; read again when a CAS loses (a peer
  // changed `.lock`, or someone joined), after a pause that doubles, a bounded number of times
  // and within the release's budget: a busy peer is never answered with a hot loop.
  void release_permits(const CallBudget& budget) {
    const auto context = "releasing Semaphore '" + name_ + "'";
    auto backoff = kResendBackoff;
    for (int race = 1;; ++race) {
      const auto timeout = budget.call_timeout(kConsulTimes.call);
      const auto ops = release_permits_ops(timeout);
      Refused refused;
      if (backend_.txn(ops, timeout, context, &refused)) {
        if (!last_in_) end_occupancy_if_last(backend_, name_, timeout);  // those since may have left
        return;
      }
      // Someone joined since: the occupancy key stays theirs.
      if (last_in_ && refused.at(ops.size() - 1, Refusal::stale)) last_in_ = 0;
      if (!refused.all(Refusal::stale)) {
        throw BackendUnavailable(context + ": Consul refused it: " + refused.describe());
      }
      if (race == kCasRaces || !backend_.pause_before_retry(budget, backoff)) {
        throw BackendUnavailable(context + ": its `.lock` changed under every one of " + std::to_string(race) +
                                 " tries");
      }
    }
  }

  // The release's transaction on `.lock` as read now (absent or someone else's: left alone).
  nlohmann::json release_permits_ops(milliseconds timeout) const {
    const auto key = encode_name(name_);
    nlohmann::json ops = nlohmann::json::array();
    const auto locks = backend_.read(key + "/.lock", false, timeout);
    if (!locks.empty() && locks.front().flags == kSemaphoreFlags) {
      auto lock = semaphore_lock(locks.front(), name_);
      for (const auto& permit : permits_) lock.holders.erase(permit->id);
      auto op = kv_op(lock.holders.empty() ? "delete-cas" : "cas", key + "/.lock");
      op["KV"]["Index"] = lock.modify_index;
      if (!lock.holders.empty()) {
        op["KV"]["Value"] = base64_encode(to_json(lock));
        op["KV"]["Flags"] = kSemaphoreFlags;
      }
      ops.push_back(op);
    }
    for (const auto& permit : permits_) ops.push_back(kv_op("delete", key + "/" + permit->id));
    ops.push_back(kv_op("delete", entry_key_));
    if (last_in_) {
      auto op = kv_op("delete-cas", occupancy_key(name_));
      op["KV"]["Index"] = last_in_;
      ops.push_back(op);
    }
    return ops;
  }

  ConsulBackend& backend_;
  std::string name_;
  std::shared_ptr<Session> session_;
  std::string entry_key_;
  EntryValue value_;
  std::vector<std::shared_ptr<Session>> permits_;
  std::uint64_t token_;
  std::shared_ptr<LossSignal> loss_;
  bool holds_key_;  // the api.Lock key: taken by a writer, kept through a downgrade
  std::uint64_t last_in_;
  bool released_ = false;
};

}  // namespace

std::unique_ptr<BackendHold> make_hold(ConsulBackend& backend, HoldParts parts) {
  return std::make_unique<ConsulHold>(backend, std::move(parts));
}

}  // namespace turnstile::detail::consul
