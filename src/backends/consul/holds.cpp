// SPDX-License-Identifier: Apache-2.0
// A hold of a queue entry in Consul's KV store (holds.hpp): its downgrade and its release.
#include "backends/consul/holds.hpp"

#include "backends/consul/consul_backend.hpp"
#include "backends/consul/election.hpp"
#include "backends/consul/occupancy.hpp"
#include "core/receipt.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail::consul {
namespace {

// What a release removes, and how: from a live hold, or from its receipt in another process
// (the holder is gone; its sessions live on until their TTL but hold nothing after this).
class EntryRelease {
 public:
  struct Parts {
    std::string name;
    std::string session_id;  // the main session's, which holds the entry (and api.Lock's key)
    std::string entry_key;
    bool lease = false;                   // a Semaphore lease
    bool holds_key = false;               // the api.Lock key: taken by a writer, kept through a downgrade
    std::vector<std::string> permit_ids;  // a lease's permit sessions
    std::uint64_t last_in = 0;            // see HoldParts::last_in
  };
  EntryRelease(ConsulBackend& backend, Parts parts) : backend_(backend), parts_(std::move(parts)) {}

  const Parts& parts() const { return parts_; }

  // Returns whether the entry was there (still the session's). Throws BackendUnavailable.
  bool run(const CallBudget& budget) {
    if (parts_.lease) return release_permits(budget);
    return release_lock(budget.call_timeout(kConsulTimes.call));
  }

 private:
  // api.Lock's Unlock and our entry's removal in one transaction that first checks the entry is
  // still ours: a resend of a release already applied (or a release after the session ended)
  // changes nothing, so it can never unlock the key for another hold of this client's session.
  // (A release with the session, never its destruction: that would impose Consul's lock-delay.)
  // The join's marker is written in it too: a late copy of the join adds no entry after it.
  bool release_lock(milliseconds timeout) {
    nlohmann::json ops = nlohmann::json::array();
    ops.push_back(kv_check_session(parts_.entry_key, parts_.session_id));
    if (parts_.holds_key) ops.push_back(kv_unlock(encode_name(parts_.name), kLockFlags, parts_.session_id));
    ops.push_back(retire_op(parts_.entry_key, parts_.session_id));
    ops.push_back(kv_op("delete", parts_.entry_key));
    // Refused or unanswered too: an earlier try, or this one, may have written it.
    const MarkerHandOver hand_over(backend_, retired_marker_of(parts_.entry_key));
    const auto results = finish(std::move(ops), timeout);
    if (parts_.holds_key) {
      // The key as we left it: the next uncontended join of ours may take it in one step.
      std::optional<std::uint64_t> released;
      for (const auto& entry : results.value_or(std::vector<KvEntry>{})) {
        if (entry.key == encode_name(parts_.name)) released = entry.modify_index;
      }
      backend_.note_released_lock(parts_.name, released);
    }
    parts_.holds_key = false;
    return results.has_value();
  }

  // Runs a release's transaction, with the occupancy key's removal when we were the last one in
  // (left out when someone joined since: then the rest of it is applied without it). Refused
  // otherwise: our entry is no longer ours (released already, or its session ended), and its
  // removal alone is made sure of.
  std::optional<std::vector<KvEntry>> finish(nlohmann::json ops, milliseconds timeout) {
    const auto context = "releasing '" + parts_.name + "'";
    const auto delete_entry = [&] {
      backend_.write("DELETE", "/v1/kv/" + url_escape(parts_.entry_key), "", timeout, context);
    };
    if (parts_.last_in != 0) {
      auto op = kv_op("delete-cas", occupancy_key(parts_.name));
      op["KV"]["Index"] = parts_.last_in;
      ops.push_back(op);
      Refused refused;
      if (auto results = backend_.txn(ops, timeout, context, &refused)) return results;
      ops.erase(ops.size() - 1);
      // Only the occupancy's CAS lost (someone joined since): the rest goes without it.
      if (!refused.only(ops.size(), Refusal::stale)) {
        delete_entry();
        return std::nullopt;
      }
    }
    auto results = backend_.txn(ops, timeout, context);
    if (!results) delete_entry();
    // Those who joined since may all have left already (a waiter that timed out).
    end_occupancy_if_last(backend_, parts_.name, timeout);
    return results;
  }

  // api.Semaphore's Release: our holders out of `.lock` by CAS (deleted when none is left),
  // the contender keys and our entry, in one transaction; read again when a CAS loses (a peer
  // changed `.lock`, or someone joined), after a pause that doubles, a bounded number of times
  // and within the release's budget: a busy peer is never answered with a hot loop.
  bool release_permits(const CallBudget& budget) {
    const auto context = "releasing Semaphore '" + parts_.name + "'";
    auto backoff = kResendBackoff;
    bool retire = true;  // the join's marker, on the main session (see release_lock)
    const MarkerHandOver hand_over(backend_, retired_marker_of(parts_.entry_key));  // however it ends
    for (int race = 1;; ++race) {
      const auto timeout = budget.call_timeout(kConsulTimes.call);
      bool ours = false;
      const auto ops = release_permits_ops(timeout, retire, ours);
      Refused refused;
      if (backend_.txn(ops, timeout, context, &refused)) {
        if (!parts_.last_in) end_occupancy_if_last(backend_, parts_.name, timeout);  // those since may have left
        return ours;
      }
      if (retire && refused.any(Refusal::invalid_session)) {
        retire = false;  // the main session is gone, our entry with it: a late join copy fails its lock
        continue;
      }
      // Someone joined since: the occupancy key stays theirs.
      if (parts_.last_in && refused.at(ops.size() - 1, Refusal::stale)) parts_.last_in = 0;
      if (!refused.all(Refusal::stale)) {
        throw BackendUnavailable(context + ": Consul refused it: " + refused.describe());
      }
      if (race == kCasRaces || !backend_.pause_before_retry(budget, backoff)) {
        throw BackendUnavailable(context + ": its `.lock` changed under every one of " + std::to_string(race) +
                                 " tries");
      }
    }
  }

  // The release's transaction on `.lock` as read now (absent or someone else's: left alone);
  // `ours` says whether any of our permits was in it.
  nlohmann::json release_permits_ops(milliseconds timeout, bool retire, bool& ours) const {
    const auto key = encode_name(parts_.name);
    nlohmann::json ops = nlohmann::json::array();
    const auto locks = backend_.read(key + "/.lock", false, timeout);
    if (!locks.empty() && locks.front().flags == kSemaphoreFlags) {
      auto lock = semaphore_lock(locks.front(), parts_.name);
      for (const auto& id : parts_.permit_ids) ours = lock.holders.erase(id) > 0 || ours;
      auto op = kv_op(lock.holders.empty() ? "delete-cas" : "cas", key + "/.lock");
      op["KV"]["Index"] = lock.modify_index;
      if (!lock.holders.empty()) {
        op["KV"]["Value"] = base64_encode(to_json(lock));
        op["KV"]["Flags"] = kSemaphoreFlags;
      }
      ops.push_back(op);
    }
    for (const auto& id : parts_.permit_ids) ops.push_back(kv_op("delete", key + "/" + id));
    if (retire) ops.push_back(retire_op(parts_.entry_key, parts_.session_id));
    ops.push_back(kv_op("delete", parts_.entry_key));
    if (parts_.last_in) {
      auto op = kv_op("delete-cas", occupancy_key(parts_.name));
      op["KV"]["Index"] = parts_.last_in;
      ops.push_back(op);
    }
    return ops;
  }

  ConsulBackend& backend_;
  Parts parts_;
};

class ConsulHold final : public BackendHold {
 public:
  ConsulHold(ConsulBackend& backend, HoldParts parts)
      : backend_(backend), session_(std::move(parts.session)), value_(std::move(parts.value)),
        permits_(std::move(parts.permits)), token_(parts.token), loss_(std::move(parts.loss)),
        release_(backend, {.name = std::move(parts.name),
                           .session_id = session_->id,
                           .entry_key = std::move(parts.entry_key),
                           .lease = value_.kind == EntryKind::lease,
                           .holds_key = value_.kind == EntryKind::exclusive,
                           .permit_ids = ids_of(permits_),
                           .last_in = parts.last_in}) {
    if (value_.election) {
      // A leader took NAME with its proposal; its token is NAME's ModifyIndex then (the same
      // transaction wrote both).
      proclaimer_ = std::make_unique<Proclaimer>(LeaderKey{.name = release_.parts().name,
                                                           .session_id = session_->id,
                                                           .entry_key = release_.parts().entry_key,
                                                           .index = token_,
                                                           .value = value_.proposal});
    }
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
    const auto& key = release_.parts().entry_key;
    const auto ops =
        nlohmann::json::array({kv_check_session(key, session_->id), kv_lock(key, to_json(value_), 0, session_->id)});
    Refused refused;  // the entry is gone or not the session's: with its session, or released
    if (!backend_.txn(ops, kConsulTimes.release_try, "downgrading '" + release_.parts().name + "'", &refused)) {
      throw HoldLost("the write lock of '" + release_.parts().name +
                     "' was lost before its downgrade (its Consul session ended): " + refused.describe());
    }
  }

  // Election::proclaim (election.hpp): NAME rewritten under our session while our entry is ours.
  void proclaim(const std::string& value) override {
    if (!proclaimer_) BackendHold::proclaim(value);  // not an election's hold: refused
    if (proclaimer_->proclaim(backend_, value)) return;
    loss_->lose("its Consul entry or leader key was gone (found by a proclaim)", LossCause::entry_gone);
    throw HoldLost("the leadership of '" + release_.parts().name + "' (fencing token " + std::to_string(token_) +
                   ") was lost: its Consul entry or key is no longer its session's; nothing was proclaimed");
  }

  void release() override {
    if (released_) return;
    const auto patience = loss_->lost_by_now() ? kLostReleaseTry : kConsulTimes.release_try;
    release_.run(CallBudget(SteadyClock::now() + patience));
    released_ = true;
    detach();
    for (auto& permit : permits_) backend_.sessions().give_back(std::move(permit));
    permits_.clear();
  }

  // "consul1 <session> <lock|lease> <holds key: 0|1> <last in> <permit sessions,...|-> <entry key> <name>"
  std::string receipt() const override {
    const auto& parts = release_.parts();
    std::string permits;
    for (const auto& id : parts.permit_ids) permits += (permits.empty() ? "" : ",") + id;
    return receipt_text({"consul1", parts.session_id, parts.lease ? "lease" : "lock", parts.holds_key ? "1" : "0",
                         std::to_string(parts.last_in), permits.empty() ? "-" : permits, parts.entry_key, parts.name});
  }

  // A session of its own that nobody renews takes over our entry (and api.Lock's key) in one
  // transaction that first checks they are still ours (a late or resent copy after they ended
  // finds them gone and writes nothing); its end deletes them, with no lock-delay. Consul ends
  // it no sooner than its TTL (at least its 10 s minimum), up to 2 x that late: the entry shows
  // the earliest end. A try after one that went unanswered reuses its session and value, and
  // finds its move done when the entry is already the kept session's. The join's marker is
  // written by the move, on the main session (see release_lock). A Semaphore lease's
  // permits live in api.Semaphore's `.lock` under sessions of their own: not kept
  // (InvalidArgument, released).
  void release_after(milliseconds keep_for) override {
    if (released_) return;
    const auto& parts = release_.parts();
    if (value_.kind == EntryKind::lease) {
      throw InvalidArgument("a Semaphore lease on Consul cannot be kept after its release (release_after)");
    }
    const CallBudget budget(SteadyClock::now() + kConsulTimes.release_try);
    const bool retry = !kept_session_.empty();
    if (!retry) create_kept_session(keep_for, budget);
    auto ops = nlohmann::json::array({kv_check_session(parts.entry_key, session_->id)});
    if (parts.holds_key) {
      ops.push_back(kv_unlock(encode_name(parts.name), kLockFlags, session_->id));
      ops.push_back(kv_lock(encode_name(parts.name), "", kLockFlags, kept_session_));
    }
    ops.push_back(kv_unlock(parts.entry_key, 0, session_->id));
    ops.push_back(kv_lock(parts.entry_key, to_json(kept_value_), 0, kept_session_));
    ops.push_back(retire_op(parts.entry_key, session_->id));
    const MarkerHandOver hand_over(backend_, retired_marker_of(parts.entry_key));  // however it ends
    Refused refused;
    const auto what = "keeping '" + parts.name + "'";
    bool moved = backend_.txn(ops, budget.call_timeout(kConsulTimes.call), what, &refused).has_value();
    if (!moved && retry) {  // an earlier try's move, applied after all?
      const auto check = nlohmann::json::array({kv_check_session(parts.entry_key, kept_session_)});
      moved = backend_.txn(check, budget.call_timeout(kConsulTimes.call), what).has_value();
    }
    released_ = true;
    detach();
    if (!moved)
      loss_->lose("its Consul entry was gone before the release: " + refused.describe(), LossCause::entry_gone);
  }

 private:
  static std::vector<std::string> ids_of(const std::vector<std::shared_ptr<Session>>& sessions) {
    std::vector<std::string> ids;
    for (const auto& session : sessions) ids.push_back(session->id);
    return ids;
  }

  void create_kept_session(milliseconds keep_for, const CallBudget& budget) {
    milliseconds applied{};
    kept_session_ = backend_.sessions().create_unrenewed(keep_for, budget.call_timeout(kConsulTimes.call), applied);
    const auto until = std::chrono::system_clock::now() + std::max(keep_for, applied);
    kept_value_ = value_;
    kept_value_.kept_until_ms = std::chrono::duration_cast<milliseconds>(until.time_since_epoch()).count();
  }

  void detach() {
    session_->lease->detach(loss_.get());
    for (const auto& permit : permits_) permit->lease->detach(loss_.get());
  }

  ConsulBackend& backend_;
  std::shared_ptr<Session> session_;
  EntryValue value_;
  std::vector<std::shared_ptr<Session>> permits_;
  std::uint64_t token_;
  std::shared_ptr<LossSignal> loss_;
  EntryRelease release_;
  bool released_ = false;
  std::string kept_session_;  // release_after's, once created
  EntryValue kept_value_;
  std::unique_ptr<Proclaimer> proclaimer_;  // an election's leader only
};

}  // namespace

std::unique_ptr<BackendHold> make_hold(ConsulBackend& backend, HoldParts parts) {
  return std::make_unique<ConsulHold>(backend, std::move(parts));
}

bool ConsulBackend::release_receipt(const std::string& receipt, Deadline deadline) {
  const auto fields = receipt_fields(receipt, "consul1", 8);
  const auto number = [](const std::string& text) {
    return !text.empty() && text.size() < 20 && text.find_first_not_of("0123456789") == std::string::npos;
  };
  if (!fields || ((*fields)[2] != "lock" && (*fields)[2] != "lease") || ((*fields)[3] != "0" && (*fields)[3] != "1") ||
      !number((*fields)[4])) {
    return Backend::release_receipt(receipt, deadline);
  }
  EntryRelease::Parts parts{.name = (*fields)[7],
                            .session_id = (*fields)[1],
                            .entry_key = (*fields)[6],
                            .lease = (*fields)[2] == "lease",
                            .holds_key = (*fields)[3] == "1",
                            .permit_ids = {},
                            .last_in = std::stoull((*fields)[4])};
  validate_name(parts.name);
  // Only an entry of that session: its key names it (<queue>/<session>-<n>).
  const auto queue = queue_prefix(parts.name);
  if (parts.session_id.empty() || !parts.entry_key.starts_with(queue + parts.session_id + "-")) {
    return Backend::release_receipt(receipt, deadline);
  }
  for (std::size_t from = 0; (*fields)[5] != "-" && from <= (*fields)[5].size();) {
    const auto comma = std::min((*fields)[5].find(',', from), (*fields)[5].size());
    parts.permit_ids.push_back((*fields)[5].substr(from, comma - from));
    from = comma + 1;
  }
  return EntryRelease(*this, std::move(parts)).run(CallBudget(deadline));
}

}  // namespace turnstile::detail::consul
