// SPDX-License-Identifier: Apache-2.0
#include "backends/consul/http.hpp"

#include <curl/curl.h>

#include <algorithm>
#include <mutex>
#include <stop_token>

#include "backends/consul/curl_transfer.hpp"
#include "core/call_budget.hpp"

#include "turnstile/error.hpp"

namespace turnstile::detail::consul {
namespace {

// Idle handles kept per Http: enough for the threads of a busy client, each with its
// kept-alive connection; more are made when needed and closed when given back.
constexpr std::size_t kSpareHandles = 8;
// A call's longest sleep between looks at the stop token is curl_multi_poll's: it is woken at
// once by curl_multi_wakeup, so this bounds nothing but a lost wake-up.
constexpr int kPollMs = 1000;
// Consul's answer to a connection over limits.http_max_conns_per_client, and the pauses before
// such a call is sent again (see call).
constexpr long kTooManyConnections = 429;
constexpr std::chrono::milliseconds kBusyPause{20};
constexpr std::chrono::milliseconds kBusyPauseMax{500};

}  // namespace

// An easy handle and the multi handle it runs in: the multi keeps the connection cache, and
// lets a stop token end a call at once (curl_multi_wakeup).
struct Http::Handle {
  CURL* easy = curl_easy_init();
  CURLM* multi = new_multi();
  ~Handle() {
    curl_easy_cleanup(easy);
    curl_multi_cleanup(multi);
  }
};

Http::Http(Endpoint endpoint) : endpoint_(std::move(endpoint)) {}
Http::~Http() = default;

std::unique_ptr<Http::Handle> Http::take() {
  {
    std::lock_guard lock(mutex_);
    if (!spare_.empty()) {
      auto handle = std::move(spare_.back());
      spare_.pop_back();
      return handle;
    }
  }
  auto handle = std::make_unique<Handle>();
  if (!handle->easy || !handle->multi)
    throw BackendUnavailable("libcurl could not make a handle for " + endpoint_.shown);
  return handle;
}

void Http::give_back(std::unique_ptr<Handle> handle) {
  std::lock_guard lock(mutex_);
  if (spare_.size() < kSpareHandles) spare_.push_back(std::move(handle));
}

namespace {

// The running part of call_each: starts requests as slots free up, collects what ends.
class Batch {
 public:
  Batch(CURLM* multi, CURL* pooled, const Endpoint& endpoint, const std::vector<Request>& requests,
        std::size_t parallel, std::chrono::milliseconds timeout, std::chrono::steady_clock::time_point until)
      : multi_(multi), endpoint_(endpoint), requests_(requests), parallel_(std::max<std::size_t>(parallel, 1)),
        timeout_(timeout), until_(until), transfers_(requests.size()), outcomes_(requests.size()) {
    for (std::size_t i = 0; i < transfers_.size(); ++i) {
      transfers_[i].easy = i == 0 ? pooled : curl_easy_init();
      transfers_[i].owns_easy = i != 0;
    }
  }

  // Runs until all ended or the stop; true when nothing was cut, so the multi's connections
  // may be kept.
  bool run(const std::stop_token& stop) {
    start_more();
    while (ended_ < outcomes_.size()) {
      int running = 0;
      curl_multi_perform(multi_, &running);
      int queued = 0;
      while (CURLMsg* message = curl_multi_info_read(multi_, &queued)) {
        if (message->msg == CURLMSG_DONE) collect(message->easy_handle, message->data.result);
      }
      start_more();
      if (ended_ == outcomes_.size()) break;
      if (stop.stop_requested()) break;
      curl_multi_poll(multi_, nullptr, 0, kPollMs, nullptr);
    }
    return cut_the_rest(stop.stop_requested());
  }

  std::vector<Outcome> outcomes() { return std::move(outcomes_); }

 private:
  void start_more() {
    while (next_ < requests_.size() && running_ < parallel_) {
      const auto now = std::chrono::steady_clock::now();
      if (now + std::chrono::milliseconds(1) >= until_) {
        for (; next_ < requests_.size(); ++next_, ++ended_) outcomes_[next_].error = "not sent in time";
        return;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until_ - now);
      auto& transfer = transfers_[next_];
      if (transfer.easy) prepare(transfer, endpoint_, requests_[next_], std::min(timeout_, left));
      if (!transfer.easy || curl_multi_add_handle(multi_, transfer.easy) != CURLM_OK) {
        outcomes_[next_++].error = "libcurl could not start the request";
        ++ended_;
        continue;
      }
      outcomes_[next_].sent_at = now;
      transfer.running = true;
      ++running_;
      ++next_;
    }
  }

  void collect(CURL* easy, CURLcode result) {
    const auto i = static_cast<std::size_t>(
        std::find_if(transfers_.begin(), transfers_.end(), [&](const Transfer& t) { return t.easy == easy; }) -
        transfers_.begin());
    auto& transfer = transfers_.at(i);
    outcomes_[i].answered_at = std::chrono::steady_clock::now();
    curl_multi_remove_handle(multi_, easy);
    transfer.running = false;
    --running_;
    ++ended_;
    if (result != CURLE_OK) {
      outcomes_[i].error = curl_easy_strerror(result);
      return;
    }
    curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &transfer.reply.status);
    outcomes_[i].reply = std::move(transfer.reply);
    report_connections(easy);
  }

  // curl reuses a connection while the server keeps it open: one it had to open for this
  // transfer is a connection, and every one after the first a reconnect (the last one closed).
  void report_connections(CURL* easy) {
    long opened = 0;
    if (!endpoint_.reports || curl_easy_getinfo(easy, CURLINFO_NUM_CONNECTS, &opened) != CURLE_OK) return;
    for (long n = 0; n < opened; ++n) {
      endpoint_.reports->opened_another();
    }
  }

  bool cut_the_rest(bool stopped) {
    bool cut = false;
    for (std::size_t i = 0; i < transfers_.size(); ++i) {
      if (outcomes_[i].reply || !outcomes_[i].error.empty()) continue;
      if (transfers_[i].running) {
        // The request may be half sent: its connection is not reused.
        curl_multi_remove_handle(multi_, transfers_[i].easy);
        cut = true;
      }
      outcomes_[i].stopped = stopped;
      outcomes_[i].error = stopped ? "stopped" : transfers_[i].running ? "cut short" : "not sent";
    }
    return !cut;
  }

  CURLM* multi_;
  const Endpoint& endpoint_;
  const std::vector<Request>& requests_;
  std::size_t parallel_;
  std::chrono::milliseconds timeout_;
  std::chrono::steady_clock::time_point until_;
  std::vector<Transfer> transfers_;
  std::vector<Outcome> outcomes_;
  std::size_t next_ = 0;
  std::size_t running_ = 0;
  std::size_t ended_ = 0;
};

}  // namespace

std::vector<Outcome> Http::call_each(const std::vector<Request>& requests, std::size_t parallel,
                                     std::chrono::milliseconds timeout, std::chrono::steady_clock::time_point until,
                                     const std::stop_token& stop) {
  if (requests.empty()) return {};
  if (stop.stop_requested()) {
    // Nothing is sent once the caller stopped (a request started now could be cut half sent).
    std::vector<Outcome> outcomes(requests.size());
    for (auto& outcome : outcomes) {
      outcome.stopped = true;
      outcome.error = "stopped";
    }
    return outcomes;
  }
  if (timeout <= std::chrono::milliseconds(0)) {
    // No time left (a passed deadline under CallLimits with floor 0): nothing is sent.
    std::vector<Outcome> outcomes(requests.size());
    for (auto& outcome : outcomes) outcome.error = "no time left before the caller's deadline";
    return outcomes;
  }
  auto handle = take();
  std::vector<Outcome> outcomes;
  bool reusable = false;
  {
    Batch batch(handle->multi, handle->easy, endpoint_, requests, parallel, timeout, until);
    std::stop_callback wake(stop, [multi = handle->multi] { curl_multi_wakeup(multi); });
    reusable = batch.run(stop);
    outcomes = batch.outcomes();
  }
  if (reusable) give_back(std::move(handle));
  return outcomes;
}

// A request refused for too many connections from this address was not read (Consul answers it
// before reading, hashicorp/go-connlimit): sent again after a pause that doubles, within the
// call's timeout, then the 429 is the answer (the caller's typed error).
Reply Http::call(const char* method, const std::string& path, const std::string& body,
                 std::chrono::milliseconds timeout, const std::stop_token& stop, bool* stopped) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  auto pause = kBusyPause;
  const auto unbounded = std::chrono::steady_clock::time_point::max();  // the timeout bounds each
  auto outcomes = call_each({Request{method, path, body}}, 1, timeout, unbounded, stop);
  while (outcomes.front().reply && outcomes.front().reply->status == kTooManyConnections &&
         std::chrono::steady_clock::now() + pause < until && !stop.stop_requested()) {
    pause_within(CallBudget(until, stop), pause);
    pause = std::min(pause * 2, kBusyPauseMax);
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (left <= std::chrono::milliseconds(0)) break;
    outcomes = call_each({Request{method, path, body}}, 1, left, unbounded, stop);
  }
  auto& outcome = outcomes.front();
  if (outcome.reply) return std::move(*outcome.reply);
  if (outcome.stopped) {
    if (stopped) {
      *stopped = true;
      return Reply{};
    }
    throw BackendUnavailable("a request to " + endpoint_.shown + " was stopped");
  }
  throw BackendUnavailable("no answer from Consul at " + endpoint_.shown + ": " + outcome.error);
}

}  // namespace turnstile::detail::consul
