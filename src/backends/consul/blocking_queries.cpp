// SPDX-License-Identifier: Apache-2.0
#include "backends/consul/blocking_queries.hpp"

#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <stop_token>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "backends/consul/curl_transfer.hpp"
#include "backends/consul/keys.hpp"
#include "backends/consul/refusals.hpp"
#include "backends/consul/timeouts.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail::consul {
namespace {

// The I/O thread's longest sleep in curl_multi_poll: new waits, disarms and the stop wake it at
// once (curl_multi_wakeup), and libcurl's timers shorten it, so this bounds only a lost wake-up.
constexpr int kPollMs = 1000;
// A query that got no answer (a restart, a cut link, its timeout) wakes its waiter this much
// later: the waiter's look then resends until the server answers, without a hot loop.
constexpr milliseconds kDroppedQueryPause = kResendBackoffMax / 4;
// A blocking query's reply is a few entries: a small receive buffer per easy handle keeps
// thousands of waiting queries cheap (libcurl's default is 16 KiB each).
constexpr long kReceiveBuffer = 4096;
// What Consul answers a connection over limits.http_max_conns_per_client (hashicorp/go-connlimit,
// before reading the request): the query was not seen, so it is as one not answered.
constexpr long kTooManyConnections = 429;

struct Queue;

// One armed wait: shared by its arm (the waiter's side) and the I/O thread.
struct Watch {
  std::mutex mutex;
  std::condition_variable wake_done;
  bool disarmed = false;  // the arm is gone: never wake
  bool fired = false;     // the wake ran or runs: its queries are out of the multi handle
  bool waking = false;    // the wake is running now
  QueryWake wake;
  BlockingPlan plan;  // the queries' URLs live here while they run
  std::vector<std::unique_ptr<Transfer>> transfers;
  // The I/O thread's own: its queue's shared query (plan.shared) and its timer, if any.
  struct Queue* queue = nullptr;
  std::optional<std::multimap<SteadyClock::time_point, Watch*>::iterator> timer;
  SteadyClock::time_point wait_ends{};  // when Consul would answer its own query unchanged
};

// A client's waiters on one queue (BlockingPlan::shared), and the one query they share once
// there are two of them (the I/O thread's own).
struct Queue {
  std::string prefix;
  std::unordered_set<Watch*> members;
  bool shared = false;                                  // members wait on `query`, not on their own
  std::uint64_t index = 0;                              // the last answer's X-Consul-Index (0: none yet)
  std::unordered_map<std::string, std::uint64_t> seen;  // its entries then: key -> ModifyIndex
  std::unique_ptr<Transfer> query;
  Request request;  // the query's URL lives here while it runs
};

}  // namespace

class BlockingQueries::Loop {
 public:
  explicit Loop(Endpoint endpoint) : endpoint_(std::move(endpoint)), multi_(new_multi()) {
    if (!multi_) throw BackendUnavailable("libcurl could not make a handle for " + endpoint_.shown);
  }
  ~Loop() { curl_multi_cleanup(multi_); }

  void start_once() {
    std::lock_guard lock(mutex_);
    if (!thread_.joinable() && !stopped_) thread_ = std::jthread([this](std::stop_token stop) { run(stop); });
  }
  void stop() {
    {
      std::lock_guard lock(mutex_);
      stopped_ = true;
    }
    thread_.request_stop();
    curl_multi_wakeup(multi_);
    if (thread_.joinable()) thread_.join();
  }
  std::size_t threads() {
    std::lock_guard lock(mutex_);
    return thread_.joinable() ? 1 : 0;
  }

  // A wait's queries, made on the waiter's thread (the I/O thread only adds them).
  std::shared_ptr<Watch> make_watch(BlockingPlan plan, QueryWake wake) {
    auto watch = std::make_shared<Watch>();
    watch->wake = std::move(wake);
    watch->plan = std::move(plan);
    for (std::size_t i = 0; i < watch->plan.queries.size(); ++i) {
      // A shared target's own query is made by the I/O thread, only while it waits alone on its
      // queue: a waiter on a shared query keeps no easy handle (~10 KiB each).
      const bool shared = watch->plan.shared && watch->plan.shared->query == i;
      watch->transfers.push_back(shared ? nullptr : new_transfer(watch->plan.queries[i], *watch));
      if (!shared && !watch->transfers.back()) {
        throw BackendUnavailable("libcurl could not make a handle for " + endpoint_.shown);
      }
    }
    return watch;
  }

  // One of `watch`'s queries on an easy handle of its own; null when libcurl cannot make one.
  std::unique_ptr<Transfer> new_transfer(const Request& query, Watch& watch) const {
    auto transfer = std::make_unique<Transfer>();
    transfer->easy = curl_easy_init();
    transfer->owns_easy = true;
    if (!transfer->easy) return nullptr;
    prepare(*transfer, endpoint_, query, watch.plan.timeout);
    curl_easy_setopt(transfer->easy, CURLOPT_BUFFERSIZE, kReceiveBuffer);
    curl_easy_setopt(transfer->easy, CURLOPT_PRIVATE, &watch);
    return transfer;
  }

  void submit(const std::shared_ptr<Watch>& watch) {
    start_once();
    {
      std::lock_guard lock(mutex_);
      incoming_.push_back(watch);
    }
    curl_multi_wakeup(multi_);
  }

  // The arm's end: once this returns, the wake neither runs nor will run. What the wake
  // captured is destroyed here, on the disarming thread, never later on the I/O thread.
  void disarm(const std::shared_ptr<Watch>& watch) {
    QueryWake dropped;
    bool in_loop = false;
    {
      std::unique_lock lock(watch->mutex);
      watch->disarmed = true;
      watch->wake_done.wait(lock, [&] { return !watch->waking; });
      dropped = std::move(watch->wake);
      in_loop = !watch->fired;
    }
    if (!in_loop) return;
    {
      std::lock_guard lock(mutex_);
      if (stopped_) return;
      disarmed_.push_back(watch);
    }
    curl_multi_wakeup(multi_);
  }

 private:
  void run(const std::stop_token& stop) {
    while (!stop.stop_requested()) {
      take_requests();
      int running = 0;
      curl_multi_perform(multi_, &running);
      int queued = 0;
      while (CURLMsg* message = curl_multi_info_read(multi_, &queued)) {
        if (message->msg == CURLMSG_DONE) ended(message->easy_handle, message->data.result);
      }
      fire_due_timers();
      curl_multi_poll(multi_, nullptr, 0, poll_ms(), nullptr);
    }
    while (!live_.empty()) drop(*live_.begin()->first);
  }

  void take_requests() {
    std::vector<std::shared_ptr<Watch>> incoming;
    std::vector<std::shared_ptr<Watch>> disarmed;
    {
      std::lock_guard lock(mutex_);
      incoming.swap(incoming_);
      disarmed.swap(disarmed_);
    }
    for (auto& watch : incoming) start(std::move(watch));
    for (const auto& watch : disarmed) {
      if (live_.count(watch.get())) drop(*watch);  // else ended already
    }
  }

  void start(std::shared_ptr<Watch> owned) {
    Watch& watch = *owned;
    live_.emplace(&watch, std::move(owned));
    const auto now = SteadyClock::now();
    if (watch.transfers.empty()) return set_timer(watch, now + watch.plan.pause);
    watch.wait_ends = now + watch.plan.wait;
    Queue* queue = watch.plan.shared ? &queue_of(watch.plan.shared->prefix) : nullptr;
    const bool shared = queue && !queue->members.empty();
    if (queue) {
      queue->members.insert(&watch);
      watch.queue = queue;
    }
    for (std::size_t i = 0; i < watch.transfers.size(); ++i) {
      if (shared && i == watch.plan.shared->query) continue;
      auto& transfer = watch.transfers[i];
      if (!transfer) transfer = new_transfer(watch.plan.queries[i], watch);  // alone on its queue
      if (transfer) transfer->running = curl_multi_add_handle(multi_, transfer->easy) == CURLM_OK;
      // Not sent: as a query that got no answer (the waiter looks again after a pause).
      if (!transfer || !transfer->running) return pause_then_wake(watch);
    }
    if (!shared) return;
    wait_on_queue(watch);
    if (!queue->shared) return share(*queue);  // its first answer judges every member
    // Its entry may have moved before the answer the queue's query now waits past.
    if (moved(*queue, *watch.plan.shared)) wake(watch, nullptr, queue->index);
  }

  // A member's wait ends when its entry moves; one shortened by its deadline also ends then, as
  // its own query would have (Consul's answer after `wait`). The queue's query is re-sent when
  // its own wait ends, without waking anyone (a waiter's look would find what it already knew).
  void wait_on_queue(Watch& member) {
    if (member.plan.wait < kBlockingWaitMax) set_timer(member, member.wait_ends);
  }

  // Whether the queue's last answer shows `target`'s entry changed or gone. An entry seen later
  // than that answer is judged by the next one.
  static bool moved(const Queue& queue, const SharedTarget& target) {
    if (queue.index == 0 || target.index > queue.index) return false;
    if (target.until_answer) return true;
    const auto found = queue.seen.find(target.key);
    return found == queue.seen.end() || found->second != target.index;
  }

  Queue& queue_of(const std::string& prefix) {
    auto& queue = queues_[prefix];
    if (!queue) {
      queue = std::make_unique<Queue>();
      queue->prefix = prefix;
    }
    return *queue;
  }

  // A second waiter on the queue: its one waiter so far stops its own query and, with every
  // later one, waits on the queue's (first sent without an index: an answer at once that says
  // where each member's entry stands).
  void share(Queue& queue) {
    queue.shared = true;
    for (Watch* member : queue.members) {
      auto& own = member->transfers.at(member->plan.shared->query);
      if (own && own->running) curl_multi_remove_handle(multi_, own->easy);
      own.reset();  // the queue's query serves it now
      wait_on_queue(*member);
    }
    send_shared(queue);
  }

  void send_shared(Queue& queue) {
    queue.query = std::make_unique<Transfer>();
    queue.query->easy = curl_easy_init();
    queue.query->owns_easy = true;
    const auto timeout = kBlockingWaitMax + kBlockingWaitMax / 16 + kBlockingSlack;
    queue.request = {"GET",
                     "/v1/kv/" + url_escape(queue.prefix) + "?recurse&index=" + std::to_string(queue.index) +
                         "&wait=" + std::to_string(kBlockingWaitMax.count()) + "ms",
                     ""};
    if (queue.query->easy) {
      prepare(*queue.query, endpoint_, queue.request, timeout);
      queue.query->running = curl_multi_add_handle(multi_, queue.query->easy) == CURLM_OK;
    }
    if (queue.query->running) {
      shared_queries_[queue.query->easy] = &queue;
      return;
    }
    queue.query.reset();
    for (Watch* member : members_of(queue)) pause_then_wake(*member);  // not sent: as no answer
  }

  static std::vector<Watch*> members_of(const Queue& queue) { return {queue.members.begin(), queue.members.end()}; }

  // Out of the loop's queries and timers, still live (its wake not run).
  void take_out(Watch& watch) {
    for (auto& transfer : watch.transfers) {
      if (transfer && std::exchange(transfer->running, false)) curl_multi_remove_handle(multi_, transfer->easy);
    }
    if (watch.timer) timers_.erase(*std::exchange(watch.timer, std::nullopt));
    Queue* queue = std::exchange(watch.queue, nullptr);
    if (!queue) return;
    queue->members.erase(&watch);
    if (!queue->members.empty()) return;
    // Its last waiter gone: so is its query (the next waiter on it blocks on its own again).
    if (queue->query) {
      shared_queries_.erase(queue->query->easy);
      if (queue->query->running) curl_multi_remove_handle(multi_, queue->query->easy);
    }
    {
      std::lock_guard lock(views_mutex_);
      views_.erase(queue->prefix);
    }
    queues_.erase(queue->prefix);
  }

  // Out of the loop altogether (its wake not run: fired or disarmed).
  std::shared_ptr<Watch> drop(Watch& watch) {
    take_out(watch);
    const auto found = live_.find(&watch);
    auto owned = std::move(found->second);
    live_.erase(found);
    return owned;
  }

  void wake(Watch& watch, std::exception_ptr error, std::uint64_t answer = 0) {
    const auto owned = drop(watch);
    fire(*owned, std::move(error), answer);
  }

  // A query that got no answer (or was refused for too many connections): the waiter looks
  // again after a pause, never in a hot loop.
  void pause_then_wake(Watch& watch) {
    take_out(watch);
    set_timer(watch, SteadyClock::now() + kDroppedQueryPause);
  }

  void set_timer(Watch& watch, SteadyClock::time_point when) {
    if (watch.timer) timers_.erase(*watch.timer);
    watch.timer = timers_.emplace(when, &watch);
  }

  void ended(CURL* easy, CURLcode result) {
    const auto shared = shared_queries_.find(easy);
    if (shared != shared_queries_.end()) return shared_ended(*shared->second, result);
    char* owner = nullptr;
    curl_easy_getinfo(easy, CURLINFO_PRIVATE, &owner);
    const auto found = live_.find(reinterpret_cast<Watch*>(owner));
    if (found == live_.end()) return;
    Watch& watch = *found->first;
    std::size_t which = 0;
    while (which + 1 < watch.transfers.size() && (!watch.transfers[which] || watch.transfers[which]->easy != easy)) {
      ++which;
    }
    auto& reply = watch.transfers[which]->reply;
    if (result == CURLE_OK) curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &reply.status);
    if (result != CURLE_OK || reply.status == kTooManyConnections) return pause_then_wake(watch);
    wake(watch, answer_error("waiting on " + watch.plan.keys.at(which), reply));
  }

  // The typed error of an answer nobody expects (a 403 of the ACL, a 500), else null.
  std::exception_ptr answer_error(const std::string& context, const Reply& reply) const {
    if (reply.status == 200 || reply.status == 404) return nullptr;
    try {
      throw_error(context, reply, endpoint_);
    } catch (...) {
      return std::current_exception();
    }
    return nullptr;
  }

  // The queue's query answered: each member whose entry is not as it saw it (changed, gone)
  // wakes; a member that saw its entry later than this answer waits for the next one (which
  // comes at once: the queue's index has moved past this answer's).
  void shared_ended(Queue& queue, CURLcode result) {
    auto query = std::move(queue.query);
    shared_queries_.erase(query->easy);
    query->running = false;
    curl_multi_remove_handle(multi_, query->easy);
    auto& reply = query->reply;
    if (result == CURLE_OK) curl_easy_getinfo(query->easy, CURLINFO_RESPONSE_CODE, &reply.status);
    // An answer without X-Consul-Index would be asked again at once: as none, after a pause.
    const bool unanswered = result != CURLE_OK || reply.status == kTooManyConnections || reply.index == 0;
    if (unanswered) {
      for (Watch* member : members_of(queue)) pause_then_wake(*member);
      return;
    }
    if (const auto error = answer_error("waiting on " + queue.prefix, reply)) {
      for (Watch* member : members_of(queue)) wake(*member, error);
      return;
    }
    publish(queue, reply);
    const auto prefix = queue.prefix;
    for (Watch* member : members_of(queue)) {
      if (moved(queue, *member->plan.shared)) wake(*member, nullptr, queue.index);
    }
    const auto still = queues_.find(prefix);
    if (still == queues_.end()) return;  // every member woke: the queue's query ends
    send_shared(*still->second);
  }

  // An answer of the queue's query: what its members are judged by, and the view their looks
  // decide on (parsed once for all of them, published before any of them wakes).
  void publish(Queue& queue, Reply& reply) {
    std::vector<KvEntry> entries;
    if (reply.status == 200) entries = parse_entries(std::string_view(reply.body));
    std::string().swap(reply.body);
    queue.seen.clear();
    for (const auto& entry : entries) queue.seen.emplace(entry.key, entry.modify_index);
    queue.index = reply.index;  // also one that went back (a snapshot restore): blocks from there
    // Only this thread replaces a queue's view: the one there now stays while the next is made.
    const auto before = view(queue.prefix, 0);
    auto next = std::make_shared<const QueueView>(make_queue_view(entries, queue.prefix, reply.index, before.get()));
    std::lock_guard lock(views_mutex_);
    views_[queue.prefix] = std::move(next);
  }

 public:
  std::shared_ptr<const QueueView> view(const std::string& prefix, std::uint64_t at_least) const {
    std::lock_guard lock(views_mutex_);
    const auto found = views_.find(prefix);
    if (found == views_.end() || found->second->index < at_least) return nullptr;
    return found->second;
  }

 private:
  void fire_due_timers() {
    const auto now = SteadyClock::now();
    while (!timers_.empty() && timers_.begin()->first <= now) wake(*timers_.begin()->second, nullptr);
  }

  static void fire(Watch& watch, std::exception_ptr error, std::uint64_t answer) {
    QueryWake wake;
    {
      std::lock_guard lock(watch.mutex);
      if (watch.disarmed || watch.fired) return;
      watch.fired = true;
      watch.waking = true;
      wake = std::move(watch.wake);
    }
    try {
      wake(std::move(error), answer);
    } catch (...) {
      // A wake must not throw (it posts the waiter's next step); nothing to tell here.
    }
    wake = nullptr;  // its captures go before the disarming thread may go on
    {
      std::lock_guard lock(watch.mutex);
      watch.waking = false;
    }
    watch.wake_done.notify_all();
  }

  int poll_ms() const {
    if (timers_.empty()) return kPollMs;
    const auto left = std::chrono::ceil<milliseconds>(timers_.begin()->first - SteadyClock::now());
    return static_cast<int>(std::clamp<milliseconds::rep>(left.count(), 0, kPollMs));
  }

  Endpoint endpoint_;
  CURLM* multi_;
  std::mutex mutex_;
  bool stopped_ = false;
  std::vector<std::shared_ptr<Watch>> incoming_;  // armed, not yet in the multi handle
  std::vector<std::shared_ptr<Watch>> disarmed_;  // to take out of it
  // The I/O thread's own: every wait it holds (queries running, a shared query's member, a
  // timer), the queues with waiters, their shared queries by handle, and the timers.
  std::unordered_map<Watch*, std::shared_ptr<Watch>> live_;
  std::unordered_map<std::string, std::unique_ptr<Queue>> queues_;
  std::unordered_map<CURL*, Queue*> shared_queries_;
  std::multimap<SteadyClock::time_point, Watch*> timers_;
  // The last answer of each shared query, for the members' looks (any thread reads them).
  mutable std::mutex views_mutex_;
  std::unordered_map<std::string, std::shared_ptr<const QueueView>> views_;
  std::jthread thread_;
};

namespace {

class QueryArm final : public WakeArm {
 public:
  QueryArm(std::shared_ptr<BlockingQueries::Loop> loop, std::shared_ptr<Watch> watch)
      : loop_(std::move(loop)), watch_(std::move(watch)) {}
  ~QueryArm() override { loop_->disarm(watch_); }

 private:
  std::shared_ptr<BlockingQueries::Loop> loop_;
  std::shared_ptr<Watch> watch_;
};

}  // namespace

BlockingQueries::BlockingQueries(Endpoint endpoint) : loop_(std::make_shared<Loop>(std::move(endpoint))) {}

BlockingQueries::~BlockingQueries() { loop_->stop(); }

std::unique_ptr<WakeArm> BlockingQueries::arm(BlockingPlan plan, QueryWake wake) {
  auto watch = loop_->make_watch(std::move(plan), std::move(wake));
  auto armed = std::make_unique<QueryArm>(loop_, watch);
  loop_->submit(watch);
  return armed;
}

std::size_t BlockingQueries::io_threads() const { return loop_->threads(); }

std::shared_ptr<const QueueView> BlockingQueries::view(const std::string& prefix, std::uint64_t at_least) const {
  return loop_->view(prefix, at_least);
}

}  // namespace turnstile::detail::consul
