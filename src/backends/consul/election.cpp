// SPDX-License-Identifier: Apache-2.0
// Leader elections on Consul (election.hpp): the leader key's flags and modes, proclaim, and
// what wakes an observer.
#include "backends/consul/election.hpp"

#include <cstdio>

#include "backends/consul/consul_backend.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail::consul {
namespace {

std::string hex_flags(std::uint64_t flags) {
  char text[32];
  std::snprintf(text, sizeof text, "0x%016llx", static_cast<unsigned long long>(flags));
  return text;
}

// A proclaim whose CAS found NAME moved (our own late copy or retire, applied meanwhile) reads
// it again and tries once more, this many times in all: never a hot loop.
constexpr int kProclaimTries = 3;

}  // namespace

std::string lock_key_value(const QueueRequest& request) {
  return request.primitive == Primitive::election ? request.value : std::string();
}

QueueMode queue_mode_of(const QueuedEntry& entry) {
  if (entry.election) return QueueMode::election;
  return entry.kind == EntryKind::lease ? QueueMode::semaphore : QueueMode::lock;
}

QueueMode lock_key_mode(const QueueRequest& request, const KvEntry& key, bool foreign) {
  const bool election = request.primitive == Primitive::election;
  if (key.flags != kLockFlags && !(election && key.flags == kGuideFlags)) {
    throw KindMismatch("'" + request.name + "': Consul key " + key.key + " has flags " + hex_flags(key.flags) +
                       (election ? ", neither api.Lock's (0x2ddccbc058a50c18) nor the leader-election guide's (0)"
                                 : ", not api.Lock's (0x2ddccbc058a50c18)") +
                       ": it is someone else's");
  }
  // An api.Lock holder is a leader to a candidate (api.Lock-based elections are that lock).
  if (!foreign) return QueueMode::none;
  return election ? QueueMode::election : QueueMode::lock;
}

std::string peer_key_mode(const KvEntry& key) {
  if (key.flags == kGuideFlags) return "election";
  if (key.flags != kLockFlags) return "";
  return key.value.empty() ? "lock" : "election";
}

bool Proclaimer::read_key(ConsulBackend& backend) {
  const auto entries = backend.read(encode_name(key_.name), false, kConsulTimes.call.cap);
  if (entries.empty() || entries.front().session != key_.session_id) return false;
  key_.index = entries.front().modify_index;
  key_.value = entries.front().value;
  return true;
}

// A proclaim has no deadline of its own: each of its calls gets what any call gets (the cap).
bool Proclaimer::proclaim(ConsulBackend& backend, const std::string& value) {
  std::lock_guard lock(mutex_);
  const auto key = encode_name(key_.name);
  const auto context = "proclaiming a new value of election '" + key_.name + "'";
  for (int attempt = 1;; ++attempt) {
    if (key_.index == 0 && !read_key(backend)) return false;
    auto check_index = kv_op("check-index", key);
    check_index["KV"]["Index"] = key_.index;
    const auto ops = nlohmann::json::array({kv_check_session(key_.entry_key, key_.session_id), check_index,
                                            kv_lock(key, value, kLockFlags, key_.session_id)});
    Refused refused;
    std::optional<std::vector<KvEntry>> results;
    try {
      results = backend.txn(ops, kConsulTimes.call.cap, context, &refused);
    } catch (const BackendUnavailable& error) {
      retire_later(backend);
      key_.index = 0;
      throw BackendUnavailable("the value of election '" + key_.name + "' may or may not have changed (" +
                               error.what() + "); it is applied at most once, and not once the background write " +
                               "that follows has landed");
    }
    if (results) {
      for (const auto& entry : *results) {
        if (entry.key == key) key_.index = entry.modify_index;
      }
      key_.value = value;
      return true;
    }
    if (refused.at(0, Refusal::check_failed) || refused.any(Refusal::invalid_session)) return false;
    if (!refused.only(1, Refusal::check_failed)) {
      throw BackendUnavailable(context + ": Consul refused it: " + refused.describe());
    }
    key_.index = 0;  // moved on: read it again (our key still, or lost)
    if (attempt == kProclaimTries) {
      throw BackendUnavailable(context + ": the key changed under each of " + std::to_string(attempt) + " tries");
    }
  }
}

// After an unknown outcome: NAME rewritten with the value it had, by a transaction that applies
// only while NAME is still as we left it (so the proclaim's copy has not applied) and our entry
// ours. Two writes in it, so that its ModifyIndex moves although the value ends as it was
// (Consul skips a write that changes nothing): a copy of the proclaim delivered later then finds
// the index moved and changes nothing. Done too when NAME has moved on (the copy applied) or
// the entry is gone.
void Proclaimer::retire_later(ConsulBackend& backend) {
  const auto key = encode_name(key_.name);
  auto check_index = kv_op("check-index", key);
  check_index["KV"]["Index"] = key_.index;
  const auto ops = nlohmann::json::array({kv_check_session(key_.entry_key, key_.session_id), check_index,
                                          kv_lock(key, key_.value + " ", kLockFlags, key_.session_id),
                                          kv_lock(key, key_.value, kLockFlags, key_.session_id)});
  const auto what = "retiring an unanswered proclaim of election '" + key_.name + "'";
  backend.removals().add(what, [&backend, ops, what](const CallBudget& budget) {
    const auto timeout = removal_timeout(budget);
    if (!timeout) return Removal::again;
    Refused refused;
    if (backend.txn(ops, *timeout, what, &refused)) return Removal::done;
    return refused.any(Refusal::check_failed) || refused.any(Refusal::invalid_session) ? Removal::done : Removal::again;
  });
}

namespace {

// Wakes an observer when NAME changes: a blocking GET on it from the index of a read made after
// the core's last look (the first wait only takes that index and returns: a change between the
// core's read and ours then costs one more look, never a lost wake-up). The blocking queries
// run on the client's one I/O thread (blocking_queries.hpp): no thread per observer.
class ConsulLeaderWatch final : public LeaderWatch {
 public:
  ConsulLeaderWatch(ConsulBackend& backend, const std::string& name) : backend_(backend), key_(encode_name(name)) {}

  void wait(Deadline deadline, const std::stop_token& stop) override {
    const CallBudget budget(deadline, stop);
    if (index_ != 0) backend_.block(std::vector<WaitTarget>{{key_, index_, false, false}}, budget);
    index_ = 0;
    if (budget.passed()) return;
    try {
      backend_.read(key_, false, budget.call_timeout(kConsulTimes.one_shot), &index_, stop);
    } catch (const BackendUnavailable&) {
      // The core's next read of the leader reports the server; the next wait reads again.
    }
  }

 private:
  ConsulBackend& backend_;
  std::string key_;
  std::uint64_t index_ = 0;  // NAME's X-Consul-Index as of the last read (0: none yet)
};

}  // namespace

std::unique_ptr<LeaderWatch> make_leader_watch(ConsulBackend& backend, const std::string& name) {
  return std::make_unique<ConsulLeaderWatch>(backend, name);
}

std::unique_ptr<LeaderWatch> ConsulBackend::watch_leader(const std::string& name) {
  return make_leader_watch(*this, name);
}

}  // namespace turnstile::detail::consul
