#include "backends/consul/http.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/socket.h>

#include <curl/curl.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <set>
#include <stop_token>

#include "turnstile/error.hpp"

namespace turnstile::detail::consul {
namespace {

// Idle handles kept per Http: enough for the threads of a busy client, each with its
// kept-alive connection; more are made when needed and closed when given back.
constexpr std::size_t kSpareHandles = 8;
// How long a connection attempt may take at most within a call's own timeout.
constexpr std::chrono::milliseconds kConnectTimeout{3000};
// A blocking query's longest sleep between looks at the stop token is curl_multi_poll's: it is
// woken at once by curl_multi_wakeup, so this bounds nothing but a lost wake-up.
constexpr int kPollMs = 1000;

curl_socket_t open_cloexec(void*, curlsocktype, curl_sockaddr* address) {
  return ::socket(address->family, address->socktype | SOCK_CLOEXEC, address->protocol);
}

std::set<int> open_descriptors() {
  std::set<int> fds;
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return fds;
  while (const dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') fds.insert(std::atoi(entry->d_name));
  }
  fds.erase(dirfd(dir));
  closedir(dir);
  return fds;
}

bool unix_socket(int fd) {
  int domain = 0;
  socklen_t size = sizeof domain;
  return getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &size) == 0 && domain == AF_UNIX;
}

// libcurl (7.88, Debian 12) makes each multi handle's wake-up socketpair without SOCK_CLOEXEC
// and offers no option for it: the Unix sockets that curl_multi_init added are marked here, so a
// program's children (`turnstile run`'s command) inherit none. Our own multis are made one at a
// time; a descriptor another thread opened meanwhile is touched only if it is a Unix socket
// without close-on-exec, which the library's rules forbid anyway.
CURLM* new_multi() {
  static std::mutex making;
  std::lock_guard lock(making);
  const auto before = open_descriptors();
  CURLM* multi = curl_multi_init();
  for (const int fd : open_descriptors()) {
    if (before.count(fd) || !unix_socket(fd)) continue;
    const int flags = fcntl(fd, F_GETFD);
    if (flags >= 0 && !(flags & FD_CLOEXEC)) fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
  }
  return multi;
}

std::size_t on_body(char* data, std::size_t size, std::size_t count, void* out) {
  static_cast<std::string*>(out)->append(data, size * count);
  return size * count;
}

std::size_t on_header(char* data, std::size_t size, std::size_t count, void* out) {
  const std::string_view line(data, size * count);
  constexpr std::string_view name = "x-consul-index:";
  if (line.size() > name.size()) {
    std::string lower(line.substr(0, name.size()));
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (lower == name)
      *static_cast<std::uint64_t*>(out) = std::strtoull(std::string(line.substr(name.size())).c_str(), nullptr, 10);
  }
  return size * count;
}

}  // namespace

// An easy handle and the multi handle it runs in: the multi keeps the connection cache, and
// lets a stop token end a blocking query (curl_multi_wakeup).
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

// One request of a batch on its easy handle: its own, or the pooled Handle's (kept: its
// connection cache lives in the multi handle, which every easy handle added to it shares).
struct Transfer {
  CURL* easy = nullptr;
  bool owns_easy = false;
  curl_slist* headers = nullptr;
  Reply reply;
  bool running = false;
  Transfer() = default;
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;
  ~Transfer() {
    curl_slist_free_all(headers);
    if (owns_easy) curl_easy_cleanup(easy);
  }
};

void prepare(Transfer& transfer, const Endpoint& endpoint, const Request& request, std::chrono::milliseconds timeout) {
  CURL* easy = transfer.easy;
  curl_easy_reset(easy);
  std::string url = endpoint.base + request.path;
  if (!endpoint.dc.empty()) url += (request.path.find('?') == std::string::npos ? "?dc=" : "&dc=") + endpoint.dc;
  curl_slist_free_all(transfer.headers);
  transfer.headers = nullptr;
  if (!endpoint.token.empty()) {
    transfer.headers = curl_slist_append(transfer.headers, ("X-Consul-Token: " + endpoint.token).c_str());
  }
  transfer.headers = curl_slist_append(transfer.headers, "Content-Type: application/json");
  curl_easy_setopt(easy, CURLOPT_URL, url.c_str());  // strings are copied, but for POSTFIELDS
  curl_easy_setopt(easy, CURLOPT_CUSTOMREQUEST, request.method.c_str());
  if (request.method != "GET") {
    curl_easy_setopt(easy, CURLOPT_POSTFIELDS, request.body.c_str());
    curl_easy_setopt(easy, CURLOPT_POSTFIELDSIZE, static_cast<long>(request.body.size()));
  }
  curl_easy_setopt(easy, CURLOPT_HTTPHEADER, transfer.headers);
  curl_easy_setopt(easy, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(easy, CURLOPT_TIMEOUT_MS, static_cast<long>(std::max<long long>(timeout.count(), 1)));
  curl_easy_setopt(easy, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(std::min(timeout, kConnectTimeout).count()) + 1);
  curl_easy_setopt(easy, CURLOPT_OPENSOCKETFUNCTION, open_cloexec);
  curl_easy_setopt(easy, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(easy, CURLOPT_WRITEDATA, &transfer.reply.body);
  curl_easy_setopt(easy, CURLOPT_HEADERFUNCTION, on_header);
  curl_easy_setopt(easy, CURLOPT_HEADERDATA, &transfer.reply.index);
  if (!endpoint.cacert.empty()) curl_easy_setopt(easy, CURLOPT_CAINFO, endpoint.cacert.c_str());
}

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

  // Runs until all ended (or, `first_only`, one was answered) or the stop; true when nothing
  // was cut, so the multi's connections may be kept.
  bool run(const std::stop_token& stop, bool first_only) {
    start_more();
    for (bool answered = false; ended_ < outcomes_.size() && !(first_only && answered);) {
      int running = 0;
      curl_multi_perform(multi_, &running);
      int queued = 0;
      while (CURLMsg* message = curl_multi_info_read(multi_, &queued)) {
        if (message->msg == CURLMSG_DONE) answered |= collect(message->easy_handle, message->data.result);
      }
      start_more();
      if (ended_ == outcomes_.size() || (first_only && answered)) break;
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

  // True when `easy` ended with an answer.
  bool collect(CURL* easy, CURLcode result) {
    const auto i = static_cast<std::size_t>(
        std::find_if(transfers_.begin(), transfers_.end(), [&](const Transfer& t) { return t.easy == easy; }) -
        transfers_.begin());
    auto& transfer = transfers_.at(i);
    curl_multi_remove_handle(multi_, easy);
    transfer.running = false;
    --running_;
    ++ended_;
    if (result != CURLE_OK) {
      outcomes_[i].error = curl_easy_strerror(result);
      return false;
    }
    curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &transfer.reply.status);
    outcomes_[i].reply = std::move(transfer.reply);
    return true;
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
                                     const std::stop_token& stop, bool first_only) {
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
    reusable = batch.run(stop, first_only);
    outcomes = batch.outcomes();
  }
  if (reusable) give_back(std::move(handle));
  return outcomes;
}

Reply Http::call(const char* method, const std::string& path, const std::string& body,
                 std::chrono::milliseconds timeout, const std::stop_token& stop, bool* stopped) {
  auto outcomes =
      call_each({Request{method, path, body}}, 1, timeout, std::chrono::steady_clock::time_point::max(), stop);
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
