// A contender's place in a queue, from join until it becomes a hold or leaves: our entry node
// and the looks that present the queue up to it to the core's loop.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backends/zookeeper/zookeeper_backend.hpp"

namespace turnstile::detail::zookeeper {

class EntryPlace : public QueuePlace {
 public:
  // Makes our node (ephemeral sequential, named PARENT/_c_<uuid>-<label><seq>).
  void enter(Deadline deadline) {
    const auto made = backend_.create_entry(
        *session_, {.parent = parent_, .label = label_, .uuid = uuid_, .data = data_, .want_token = true},
        backend_.call_bound(*session_, deadline));
    node_ = made.node;
    token_ = made.token;
  }
  // A look's calls give up a session timeout after the connection went down; the waiter waits
  // on through the outage (a leader election, a restart) until its own deadline or stop, as
  // Curator's recipes do: the session reconnects and the look answers, or the session expired
  // and our entry with it (QueueEntryGone: the core joins again).
  template <class Look>
  Standing through_outages(Deadline deadline, Look&& look) {
    const CallBudget caller(deadline, request_.stop);
    for (;;) {
      try {
        return look();
      } catch (const ConnectionGaveUp&) {
        // A stop is presented as our entry gone, as queue_step does: the core gives up and leaves.
        if (caller.stopped()) throw QueueEntryGone{};
        if (caller.passed()) throw;
        if (!backend_.connection().wait_connected(*session_, caller)) {
          if (caller.stopped()) throw QueueEntryGone{};
          throw;
        }
      }
    }
  }
  // Waits for the entry the verdict names, by its node: its deletion, or (exclusive_end) also
  // its downgrade.
  void wait(const Verdict& verdict, Deadline deadline, const std::stop_token& stop) override {
    const auto target = parent_ + "/" + nodes_.at(verdict.index);
    // A long queue's listing is not kept while we sleep: memory per waiter stays constant (the
    // next look lists again).
    std::vector<std::string>().swap(nodes_);
    queue_step([&] {
      backend_.wait_for_change(*session_, target, {deadline, stop},
                               verdict.wait == WaitFor::exclusive_end ? still_writing : nullptr);
    });
  }
  void leave() noexcept override {
    if (left_ || node_.empty()) return;
    left_ = true;
    backend_.remove_eventually(*session_, parent_ + "/" + node_);
  }

 protected:
  EntryPlace(ZookeeperBackend& backend, std::shared_ptr<Session> session, const QueueRequest& request,
             std::string parent, const char* label, std::string data)
      : backend_(backend), session_(std::move(session)), request_(request), path_(backend.path_of(request.name)),
        parent_(std::move(parent)), label_(label), data_(std::move(data)) {}

  // Of our parent's `children`, the live entries up to ours, in queue order.
  std::vector<EntryNode> entries_up_to_ours(const std::vector<std::string>& children) const {
    auto entries = sorted_entries(children);
    const auto me = index_of(entries, node_);
    if (me == entries.size()) throw QueueEntryGone{};  // our ephemeral node is gone
    entries.resize(me + 1);
    return entries;
  }
  void remember(const std::vector<EntryNode>& entries) {
    nodes_.clear();
    for (const auto& entry : entries) nodes_.push_back(entry.node);
  }

  ZookeeperBackend& backend_;
  std::shared_ptr<Session> session_;
  QueueRequest request_;
  std::string path_;    // the name's node
  std::string parent_;  // our node's parent: the name's node, or a semaphore's line
  const char* label_;
  std::string data_;
  std::string uuid_ = random_uuid();
  std::string node_;                // ours
  std::uint64_t token_ = 0;         // its fencing token (a lock's hold keeps it)
  std::vector<std::string> nodes_;  // the last look's entries up to ours
  bool left_ = false;
};

// Mutex, RecursiveMutex, SharedMutex (lock_place.cpp).
std::unique_ptr<EntryPlace> make_lock_place(ZookeeperBackend& backend, std::shared_ptr<Session> session,
                                            const QueueRequest& request);
// Semaphore (lease_place.cpp).
std::unique_ptr<EntryPlace> make_lease_place(ZookeeperBackend& backend, std::shared_ptr<Session> session,
                                             const QueueRequest& request, bool try_once);

}  // namespace turnstile::detail::zookeeper
