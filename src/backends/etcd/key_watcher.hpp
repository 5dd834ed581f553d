// Watches the key of every hold on one Watch stream of its own. Keep-alives prove only that
// the lease lives; a key deleted by hand (`etcdctl del`), with its lease (`etcdctl lease
// revoke`), or overwritten by another writer means the hold is gone, and its holder is told at
// once. Two threads: the reader owns the stream and reads it; the worker writes watch requests,
// re-reads keys whose watch etcd cancelled (a compacted start revision) and tells the losses,
// so that no user callback runs while the stream is open (fork handling counts it as a call).
#pragma once

#include <condition_variable>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "backends/etcd/connection.hpp"
#include "core/loss_signal.hpp"

namespace turnstile::detail::etcd {

class KeyWatcher {
 public:
  struct Watched {
    std::string key;
    std::int64_t create_revision = 0;
    std::int64_t lease = 0;
    std::shared_ptr<LossSignal> loss;
    // Guarded by the watcher's mutex:
    std::vector<std::string> values;     // the values this client wrote to the key
    std::int64_t from_revision = 0;      // the first revision not yet seen
    std::int64_t watch_id = -1;          // on the current stream, once etcd created the watch
    bool done = false;                   // released or lost: no longer watched
    SteadyClock::time_point not_before;  // its first watch request is sent then
  };

  // `lost` runs (on the worker thread) after a hold was told that its key went.
  KeyWatcher(Connection& connection, std::function<void()> lost);
  ~KeyWatcher() { stop(); }

  void stop();

  // From `seen_revision` + 1 on: the key was read as ours at `seen_revision`.
  std::shared_ptr<Watched> watch(std::string key, std::int64_t create_revision, std::int64_t lease, std::string value,
                                 std::int64_t seen_revision, std::shared_ptr<LossSignal> loss);
  // Before this client writes `value` to the key itself (a downgrade).
  void allow(Watched& watched, std::string value);
  // Before this client deletes the key itself (a release).
  void unwatch(const std::shared_ptr<Watched>& watched);

 private:
  using Lock = std::unique_lock<std::mutex>;

  bool allowed(const Watched& watched, const mvccpb::KeyValue& kv) const;
  // With the mutex held: no longer watched, its watch cancelled; true when a cancel is queued.
  bool unwatch_locked(const std::shared_ptr<Watched>& watched);
  // With the mutex held: the hold is told by the worker.
  void lose_locked(const std::shared_ptr<Watched>& watched, std::string reason);

  void read_loop(std::stop_token stop);
  grpc::Status run_stream(const std::stop_token& stop);
  void handle(const pb::WatchResponse& response);
  void handle_created(const pb::WatchResponse& response);

  void work_loop(std::stop_token stop);
  // Waits until the worker has something to do now; false when stopped.
  bool wait_for_work(Lock& lock, const std::stop_token& stop);
  bool other_work() const;
  void tell_loss(Lock& lock);
  void send_request(Lock& lock);
  void recheck(Lock& lock);

  Connection& connection_;
  std::function<void()> lost_;
  std::mutex mutex_;
  std::condition_variable_any cv_;
  std::set<std::shared_ptr<Watched>> watched_;
  grpc::ClientReaderWriter<pb::WatchRequest, pb::WatchResponse>* stream_ = nullptr;  // the current one
  bool writing_ = false;
  bool worker_timed_ = false;                      // the worker waits for the first queued create's time
  std::list<std::shared_ptr<Watched>> creates_;    // to send on the current stream
  std::list<std::shared_ptr<Watched>> in_flight_;  // sent, not yet answered `created`
  std::list<std::int64_t> cancels_;
  std::list<std::shared_ptr<Watched>> rechecks_;
  std::list<std::pair<std::shared_ptr<Watched>, std::string>> losses_;
  std::map<std::int64_t, std::shared_ptr<Watched>> by_id_;
  // Last: they stop first.
  std::jthread reader_;
  std::jthread worker_;
};

}  // namespace turnstile::detail::etcd
