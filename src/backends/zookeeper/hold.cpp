// SPDX-License-Identifier: Apache-2.0
#include <cstdio>
#include <cstdlib>

#include "backends/zookeeper/zookeeper_backend.hpp"
#include "core/receipt.hpp"

namespace turnstile::detail::zookeeper {

ZookeeperHold::ZookeeperHold(ZookeeperBackend& backend, std::shared_ptr<Session> session,
                             std::vector<std::string> paths, std::uint64_t token, std::shared_ptr<LossSignal> loss,
                             bool election)
    : backend_(backend), session_(std::move(session)), paths_(std::move(paths)), token_(token), loss_(std::move(loss)),
      lease_(session_->lease()), election_(election) {
  lease_->attach(loss_);  // lost at once if the lease is
  // The session may outlive our nodes (deleted by hand or by a peer): watched, so that this
  // hold is told at once rather than never.
  backend_.connection().watch_held(*session_, paths_, loss_);
}

ZookeeperHold::~ZookeeperHold() {
  backend_.connection().unwatch_held(paths_);
  if (!released_) lease_->detach(loss_.get());  // the core releases first; this guards misuse
}

void ZookeeperHold::downgrade() {
  // The entry keeps its place and token: its data now says "shared", which turnstile readers
  // behind it read (their watch on it fires). Curator's readers still wait for it: safe.
  const int rc =
      session_->set(paths_.front(), node_data("downgraded", backend_.holder_label()), -1, session_->short_budget());
  if (rc == ZOK) return;
  if (rc == ZNONODE || session_gone(rc)) {
    loss_->lose("its ZooKeeper session expired", LossCause::session_expired);
    return;
  }
  // Connection trouble: the set may or may not have been applied. Either way the entry is
  // consistent (a writer's or a downgraded one, same place, same token) and setting it again
  // is idempotent: the core retries, or releases the hold whole.
  throw_error("downgrade of '" + paths_.front() + "'", rc);
}

void ZookeeperHold::release() {
  if (released_) return;
  // Bounded, so unlock never waits for a silent link: an unanswered release is retried by the
  // core. Nothing is sent while the connection is known to be down.
  const auto bound = session_->short_budget();
  int rc = ZCONNECTIONLOSS;
  if (session_->expired()) {
    rc = ZSESSIONEXPIRED;
  } else if (session_->connected()) {
    // Our own deletion is no loss. (Not watched again if this attempt fails: the hold is being
    // given up, and the retry tells a node already gone apart.)
    backend_.connection().unwatch_held(paths_);
    // Leases go in one transaction, so a release never leaves some of them behind.
    std::vector<Session::Op> ops;
    for (const auto& path : paths_) ops.push_back(Session::Op::remove(path));
    rc = paths_.size() == 1 ? session_->remove(paths_.front(), bound) : session_->multi(ops, bound);
    if (connection_trouble(rc)) unconfirmed_release_ = true;
  }
  if (rc == ZNONODE && paths_.size() > 1) {
    // Some are gone already (an earlier attempt whose answer was lost): delete the rest.
    rc = ZOK;
    for (const auto& path : paths_) {
      const int one = session_->remove(path, bound);
      if (one != ZOK && one != ZNONODE) rc = one;
    }
  }
  settle_release(rc);
}

void ZookeeperHold::settle_release(int rc) {
  if (rc == ZNONODE && unconfirmed_release_ && !session_->expired()) {
    // An earlier attempt's reply was lost: it did remove our nodes (nobody else deletes an
    // ephemeral node of a live session of ours).
    rc = ZOK;
  }
  if (connection_trouble(rc)) {
    if (session_->connected()) unconfirmed_release_ = true;
    // The core retries later (BackendUnavailable); the node stays ours meanwhile.
    throw_error("release of '" + paths_.front() + "'", rc);
  }
  released_ = true;
  lease_->detach(loss_.get());
  if (rc == ZOK) {
    if (session_->expired()) loss_->lose("its ZooKeeper session expired", LossCause::session_expired);
    return;
  }
  if (rc == ZNONODE || session_gone(rc)) {
    loss_->lose("its ZooKeeper session expired before the release", LossCause::session_expired);
    return;
  }
  throw_error("release of '" + paths_.front() + "'", rc);
}

void ZookeeperHold::release_pipelined(ReleaseDone done) {
  if (released_ || paths_.size() != 1 || unconfirmed_release_ || session_->expired() || !session_->connected()) {
    return BackendHold::release_pipelined(std::move(done));
  }
  backend_.connection().unwatch_held(paths_);  // our own deletion is no loss
  session_->remove_pipelined(paths_.front(), [this, done = std::move(done)](int rc) {
    if (connection_trouble(rc)) unconfirmed_release_ = true;  // it was sent: it may have been applied
    std::exception_ptr error;
    try {
      settle_release(rc);
    } catch (...) {
      error = std::current_exception();
    }
    done(error);  // may end this hold: nothing of it is touched after
  });
}

std::string ZookeeperHold::receipt() const {
  char owner[17];
  std::snprintf(owner, sizeof owner, "%llx", static_cast<unsigned long long>(session_->id()));
  std::vector<std::string> fields{"zk1", owner};
  fields.insert(fields.end(), paths_.begin(), paths_.end());
  return receipt_text(fields);
}

// Each node is deleted only while it is still the dead holder's (its ephemeralOwner is the
// receipt's session) and at the version just read; nodes are named by their creator's
// protection id, so no one else's node can carry the name. Closing the session instead would
// do too, but it would take every other node of that session with it.
bool ZookeeperBackend::release_receipt(const std::string& receipt, Deadline deadline) {
  const auto fields = receipt_fields(receipt, "zk1", 0);
  char* end = nullptr;
  const auto owner = fields && fields->size() > 2 ? std::strtoull((*fields)[1].c_str(), &end, 16) : 0;
  if (owner == 0 || *end != '\0') return Backend::release_receipt(receipt, deadline);
  for (std::size_t i = 2; i < fields->size(); ++i) {
    if (!(*fields)[i].starts_with('/')) return Backend::release_receipt(receipt, deadline);
  }
  const CallBudget caller(deadline);
  const auto session = session_for(caller);
  bool removed = false;
  for (std::size_t i = 2; i < fields->size(); ++i) {
    const auto& path = (*fields)[i];
    const auto bound = call_bound(*session, caller);
    Stat stat{};
    int rc = session->exists(path, false, bound, &stat);
    if (rc == ZOK && static_cast<unsigned long long>(stat.ephemeralOwner) != owner) continue;  // not the holder's
    if (rc == ZOK) rc = session->remove(path, bound, stat.version);
    if (rc == ZOK) {
      removed = true;
    } else if (rc != ZNONODE && rc != ZBADVERSION) {
      throw_error("release of '" + path + "' by its receipt", rc);
    }
  }
  return removed;
}

}  // namespace turnstile::detail::zookeeper
