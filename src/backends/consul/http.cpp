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
    if (lower == name) *static_cast<std::uint64_t*>(out) = std::strtoull(std::string(line.substr(name.size())).c_str(), nullptr, 10);
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
  if (!handle->easy || !handle->multi) throw BackendUnavailable("libcurl could not make a handle for " + endpoint_.shown);
  return handle;
}

void Http::give_back(std::unique_ptr<Handle> handle) {
  std::lock_guard lock(mutex_);
  if (spare_.size() < kSpareHandles) spare_.push_back(std::move(handle));
}

Reply Http::call(const char* method, const std::string& path, const std::string& body, std::chrono::milliseconds timeout,
                 const std::stop_token& stop, bool* stopped) {
  auto handle = take();
  CURL* easy = handle->easy;
  curl_easy_reset(easy);
  Reply reply;
  std::string url = endpoint_.base + path;
  if (!endpoint_.dc.empty()) url += (path.find('?') == std::string::npos ? "?dc=" : "&dc=") + endpoint_.dc;
  curl_slist* headers = nullptr;
  const std::string token_header = "X-Consul-Token: " + endpoint_.token;
  if (!endpoint_.token.empty()) headers = curl_slist_append(headers, token_header.c_str());
  headers = curl_slist_append(headers, "Content-Type: application/json");
  curl_easy_setopt(easy, CURLOPT_URL, url.c_str());
  curl_easy_setopt(easy, CURLOPT_CUSTOMREQUEST, method);
  if (std::string_view(method) != "GET") {
    curl_easy_setopt(easy, CURLOPT_POSTFIELDS, body.c_str());
    curl_easy_setopt(easy, CURLOPT_POSTFIELDSIZE, static_cast<long>(body.size()));
  }
  curl_easy_setopt(easy, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(easy, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(easy, CURLOPT_TIMEOUT_MS, static_cast<long>(std::max<long long>(timeout.count(), 1)));
  curl_easy_setopt(easy, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(std::min(timeout, kConnectTimeout).count()) + 1);
  curl_easy_setopt(easy, CURLOPT_OPENSOCKETFUNCTION, open_cloexec);
  curl_easy_setopt(easy, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(easy, CURLOPT_WRITEDATA, &reply.body);
  curl_easy_setopt(easy, CURLOPT_HEADERFUNCTION, on_header);
  curl_easy_setopt(easy, CURLOPT_HEADERDATA, &reply.index);
  if (!endpoint_.cacert.empty()) curl_easy_setopt(easy, CURLOPT_CAINFO, endpoint_.cacert.c_str());

  curl_multi_add_handle(handle->multi, easy);
  CURLcode result = CURLE_OK;
  bool was_stopped = false;
  {
    std::stop_callback wake(stop, [multi = handle->multi] { curl_multi_wakeup(multi); });
    for (bool done = false; !done;) {
      int running = 0;
      curl_multi_perform(handle->multi, &running);
      int queued = 0;
      while (CURLMsg* message = curl_multi_info_read(handle->multi, &queued)) {
        if (message->msg == CURLMSG_DONE) {
          result = message->data.result;
          done = true;
        }
      }
      if (done) break;
      if (stop.stop_requested()) {
        was_stopped = true;
        break;
      }
      curl_multi_poll(handle->multi, nullptr, 0, kPollMs, nullptr);
    }
  }
  curl_multi_remove_handle(handle->multi, easy);
  curl_slist_free_all(headers);
  curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &reply.status);
  if (was_stopped) {
    // The request may be half sent: this connection is not reused.
    handle.reset();
    if (stopped) {
      *stopped = true;
      return reply;
    }
    throw BackendUnavailable("a request to " + endpoint_.shown + " was stopped");
  }
  if (result != CURLE_OK) {
    throw BackendUnavailable(std::string("no answer from Consul at ") + endpoint_.shown + ": " + curl_easy_strerror(result));
  }
  give_back(std::move(handle));
  return reply;
}

void throw_error(const std::string& context, const Reply& reply, const Endpoint& endpoint) {
  std::string text = reply.body.substr(0, 200);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  const auto what = context + " at " + endpoint.shown + ": HTTP " + std::to_string(reply.status) + " " + text;
  if (reply.status == 403) throw AccessDenied(what);
  if (reply.status == 400 || reply.status == 413) throw InvalidArgument(what);
  throw BackendUnavailable(what);
}

}  // namespace turnstile::detail::consul
