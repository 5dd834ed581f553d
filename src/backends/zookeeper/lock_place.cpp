// SPDX-License-Identifier: Apache-2.0
#include "backends/zookeeper/places.hpp"

namespace turnstile::detail::zookeeper {

namespace {

// Mutex, RecursiveMutex, SharedMutex: Curator's lock nodes, children of the name's node. An
// election's candidates are LeaderLatch's nodes there, with the value as their data (raw bytes,
// so Curator's getLeader().getId() is it) and a marked protection id (proclaim looks for it).
class LockPlace final : public EntryPlace {
 public:
  LockPlace(ZookeeperBackend& backend, std::shared_ptr<Session> session, const QueueRequest& request)
      : EntryPlace(backend, session, request, backend.path_of(request.name), label_of(request),
                   data_of(request, backend)),
        election_(request.primitive == Primitive::election) {
    if (election_) uuid_ = marked_uuid();
  }

  Standing look(Deadline deadline) override {
    return through_outages(deadline, [&] { return look_once(deadline); });
  }
  Standing look_once(Deadline deadline) {
    return queue_step([&] {
      const auto bound = backend_.call_bound(*session_, {deadline, request_.stop});
      const auto children = list_parent(bound);  // path_ is our parent
      auto entries = entries_up_to_ours(children);
      if (request_.kind == EntryKind::shared) present_downgrades(entries, bound);
      Standing standing;
      standing.mode = mode_ahead(entries);
      // A semaphore on the same name is a kind mismatch (we joined first, then looked: of two
      // racing contenders at least one sees the other).
      if (semaphore_in_use(children, bound)) standing.mode = QueueMode::semaphore;
      for (const auto& entry : entries) standing.entries.push_back({entry.kind, 1});
      remember(entries);
      return standing;
    });
  }
  std::unique_ptr<BackendHold> hold(std::shared_ptr<LossSignal> loss) override {
    return std::make_unique<ZookeeperHold>(backend_, session_, std::vector<std::string>{path_ + "/" + node_}, token_,
                                           std::move(loss), election_);
  }

 private:
  static std::string data_of(const QueueRequest& request, const ZookeeperBackend& backend) {
    if (request.primitive == Primitive::election) return request.value;
    return node_data(request.kind == EntryKind::shared ? "shared" : "exclusive", backend.holder_label());
  }
  // What the entries ahead of ours are: one name is never both a lock and an election (a latch
  // node is an election's; any other entry a lock's). Of two racing contenders the later one
  // sees the earlier one ahead.
  QueueMode mode_ahead(const std::vector<EntryNode>& entries) const {
    QueueMode mode = QueueMode::none;
    for (std::size_t i = 0; i + 1 < entries.size(); ++i) {
      const auto seen = entries[i].latch ? QueueMode::election : QueueMode::lock;
      if (mode == QueueMode::none || seen != (election_ ? QueueMode::election : QueueMode::lock)) mode = seen;
    }
    return mode;
  }
  // A SharedMutex's nodes are named as Curator's InterProcessReadWriteLock names them, a
  // Mutex's as InterProcessMutex's.
  static const char* label_of(const QueueRequest& request) {
    if (request.primitive == Primitive::election) return kLatchLabel;
    if (request.kind == EntryKind::shared) return kReadLabel;
    return request.primitive == Primitive::shared_mutex ? kWriteLabel : kMutexLabel;
  }
  // A reader waits for the nearest writer ahead that has not downgraded (its node's data says
  // so): the writers ahead are read, nearest first, until one still writes. Downgraded ones are
  // presented as shared, ones gone meanwhile not at all; those further ahead as their names say
  // (the predicate looks no further than the first writer).
  void present_downgrades(std::vector<EntryNode>& entries, const CallBudget& bound) {
    for (std::size_t i = entries.size() - 1; i-- > 0;) {
      if (entries[i].kind != EntryKind::exclusive) continue;
      const auto data = backend_.read(*session_, path_ + "/" + entries[i].node, false, bound);
      if (!data) {
        entries.erase(entries.begin() + static_cast<std::ptrdiff_t>(i));
      } else if (still_writing(*data)) {
        return;
      } else {
        entries[i].kind = EntryKind::shared;
      }
    }
  }
  bool semaphore_in_use(const std::vector<std::string>& children, const CallBudget& bound) {
    for (const auto& child : children) {
      if (child != "locks" && child != "leases") continue;
      Stat stat{};
      const int rc = session_->exists(path_ + "/" + child, false, bound, &stat);
      check_session(*session_, rc);
      if (rc == ZOK && stat.numChildren > 0) return true;
    }
    return false;
  }

  bool election_;
};

}  // namespace

std::unique_ptr<EntryPlace> make_lock_place(ZookeeperBackend& backend, std::shared_ptr<Session> session,
                                            const QueueRequest& request) {
  return std::make_unique<LockPlace>(backend, std::move(session), request);
}

}  // namespace turnstile::detail::zookeeper
