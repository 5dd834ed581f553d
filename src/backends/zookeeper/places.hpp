// SPDX-License-Identifier: Apache-2.0
// A contender's place in a queue, from join until it becomes a hold or leaves: our entry node
// and the looks that present the queue up to it to the core's loop.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backends/zookeeper/zookeeper_backend.hpp"

namespace turnstile::detail::zookeeper {

class EntryPlace : public QueuePlace {
 public:
  // Makes our node (ephemeral sequential, named PARENT/_c_<uuid>-<label><seq>).
  // The first look's listing of our parent comes in the create's round trip (pipelined behind it).
  // The acquire's stop ends the wait for the create's answer too (a cancel while the server is
  // paused): a node made meanwhile is found and removed in the background (create_entry).
  void enter(Deadline deadline) {
    auto made = backend_.create_entry(
        *session_,
        {.parent = parent_, .label = label_, .uuid = uuid_, .data = data_, .want_token = true, .want_listing = true},
        backend_.call_bound(*session_, {deadline, request_.stop}));
    node_ = made.node;
    token_ = made.token;
    listed_on_entry_ = std::move(made.listing);
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
    const auto target = waited_for(verdict);
    queue_step([&] { backend_.wait_for_change(*session_, target, {deadline, stop}, still_blocks(verdict)); });
  }
  // wait() without a thread: the watch's event (or the session's end) runs `wake` on the C
  // client's event thread. Nothing waits for the server here.
  std::unique_ptr<WakeArm> arm(const Verdict& verdict, Deadline, Wake wake) override {
    const auto target = waited_for(verdict);
    return backend_.arm_on_change(*session_, target, std::move(wake), still_blocks(verdict));
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
  // Our parent's children: read after our create (the first look's, sent with it), else now.
  std::vector<std::string> list_parent(const CallBudget& bound) {
    if (listed_on_entry_) {
      auto children = std::move(*listed_on_entry_);
      listed_on_entry_.reset();
      return children;
    }
    return backend_.list(*session_, parent_, false, bound);
  }
  void remember(const std::vector<EntryNode>& entries) {
    nodes_.clear();
    for (const auto& entry : entries) nodes_.push_back(entry.node);
  }
  // The path of the entry the verdict names. A long queue's listing is not kept while we wait:
  // memory per waiter stays constant (the next look lists again).
  std::string waited_for(const Verdict& verdict) {
    auto target = parent_ + "/" + nodes_.at(verdict.index);
    std::vector<std::string>().swap(nodes_);
    return target;
  }
  // A writer's downgrade ends a reader's wait too: its node's data says so.
  static auto still_blocks(const Verdict& verdict) -> bool (*)(const std::string&) {
    return verdict.wait == WaitFor::exclusive_end ? still_writing : nullptr;
  }

  ZookeeperBackend& backend_;
  std::shared_ptr<Session> session_;
  QueueRequest request_;
  std::string path_;    // the name's node
  std::string parent_;  // our node's parent: the name's node, or a semaphore's line
  const char* label_;
  std::string data_;
  std::string uuid_ = random_uuid();
  std::string node_;                                         // ours
  std::uint64_t token_ = 0;                                  // its fencing token (a lock's hold keeps it)
  std::vector<std::string> nodes_;                           // the last look's entries up to ours
  std::optional<std::vector<std::string>> listed_on_entry_;  // read with our create, for the first look
  bool left_ = false;
};

// Mutex, RecursiveMutex, SharedMutex (lock_place.cpp).
std::unique_ptr<EntryPlace> make_lock_place(ZookeeperBackend& backend, std::shared_ptr<Session> session,
                                            const QueueRequest& request);
// Semaphore (lease_place.cpp).
std::unique_ptr<EntryPlace> make_lease_place(ZookeeperBackend& backend, std::shared_ptr<Session> session,
                                             const QueueRequest& request, bool try_once);

}  // namespace turnstile::detail::zookeeper
