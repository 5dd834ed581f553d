// SPDX-License-Identifier: Apache-2.0
// What wakes an election's observer (LeaderObserver): etcd's own events, on the key watcher's
// one stream, as concurrency.Election's Observe watches them. No thread per observer.
#include <condition_variable>
#include <mutex>

#include "backends/etcd/etcd_backend.hpp"

namespace turnstile::detail::etcd {
namespace {

// A watch of every key under NAME/ (a candidate joining, leaving, or proclaiming), armed on the
// key watcher and armed again after each wake from the first revision it has not brought, so
// that nothing between two waits is missed. The first starts after a read made before the
// observer's first look (the core reads the leader after creating the watch); without that
// read it starts from when etcd creates it. Wakes early (a nested name's key, a waiter's
// join): the core only reads the leader again.
class EtcdLeaderWatch final : public LeaderWatch {
 public:
  EtcdLeaderWatch(EtcdBackend& backend, const std::string& name)
      : backend_(backend), prefix_(name + "/"), state_(std::make_shared<State>()) {
    next_revision_ = current_revision();
  }
  ~EtcdLeaderWatch() override {
    if (armed_) backend_.key_watcher().disarm(armed_);
  }

  void wait(Deadline deadline, const std::stop_token& stop) override {
    if (!armed_) arm();
    std::unique_lock lock(state_->mutex);
    const auto woken = [&] { return state_->woken; };
    if (deadline) state_->cv.wait_until(lock, stop, *deadline, woken);
    else state_->cv.wait(lock, stop, woken);
    if (!state_->woken) return;  // the deadline or the stop: the watch stays armed
    state_->woken = false;
    lock.unlock();
    // Its events were counted up to here; a wake without any (a cancelled, compacted watch)
    // starts again after a fresh read.
    const auto reached = armed_->from_revision;
    next_revision_ = reached > next_revision_ ? reached : current_revision();
    backend_.key_watcher().disarm(armed_);
    armed_.reset();
  }

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable_any cv;
    bool woken = false;
  };

  // The store's revision now + 1 (0, from when etcd creates the watch, when etcd did not answer).
  std::int64_t current_revision() {
    try {
      auto read = key_range(prefix_);
      read.set_count_only(true);
      const auto answer = backend_.connection().range(read, CallBudget(SteadyClock::now() + kEtcdTimes.leave_try));
      return answer.header().revision() + 1;
    } catch (const Error&) {
      return 0;
    }
  }

  void arm() {
    pb::WatchCreateRequest watch;
    watch.set_key(prefix_);
    watch.set_range_end(prefix_end(prefix_));
    watch.set_start_revision(next_revision_);
    armed_ = backend_.key_watcher().arm(watch, 0, [state = state_] {
      std::lock_guard lock(state->mutex);
      state->woken = true;
      state->cv.notify_all();
    });
  }

  EtcdBackend& backend_;
  const std::string prefix_;
  std::shared_ptr<State> state_;
  std::shared_ptr<KeyWatcher::Watched> armed_;
  std::int64_t next_revision_ = 0;
};

}  // namespace

std::unique_ptr<LeaderWatch> EtcdBackend::watch_leader(const std::string& name) {
  return std::make_unique<EtcdLeaderWatch>(*this, name);
}

}  // namespace turnstile::detail::etcd
