// SPDX-License-Identifier: Apache-2.0
#include "wakeups/probes.hpp"

#include <netdb.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <utility>

namespace wakeups {

// ---- talking to the servers (loopback, plain sockets) -------------------------------------

// The first host:port of a test server's URL (scheme://[user@]host:port[,...][/...][?...]).
HostPort host_port(const std::string& url) {
  auto rest = url.substr(url.find("://") + 3);
  rest = rest.substr(0, rest.find_first_of("/?,"));
  if (const auto at = rest.rfind('@'); at != std::string::npos) rest = rest.substr(at + 1);
  const auto colon = rest.rfind(':');
  return {rest.substr(0, colon), rest.substr(colon + 1)};
}

namespace {

int connect_to(const HostPort& where) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(where.host.c_str(), where.port.c_str(), &hints, &found) != 0) return -1;
  int fd = socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && connect(fd, found->ai_addr, found->ai_addrlen) != 0) {
    close(fd);
    fd = -1;
  }
  freeaddrinfo(found);
  return fd;
}

}  // namespace

// Sends `request` and reads until the server closes (HTTP/1.0, ZooKeeper's four-letter words).
std::string ask(const HostPort& where, const std::string& request) {
  const int fd = connect_to(where);
  if (fd < 0) return "";
  std::string reply;
  if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(request.size())) {
    char buffer[65536];
    for (ssize_t n; (n = recv(fd, buffer, sizeof buffer, 0)) > 0;) reply.append(buffer, n);
  }
  close(fd);
  return reply;
}

namespace {

std::string http_get(const HostPort& where, const std::string& path) {
  return ask(where, "GET " + path + " HTTP/1.0\r\nHost: " + where.host + "\r\n\r\n");
}

}  // namespace

// The number after `key` (and the separator that follows it) in `text`, 0 when absent.
double number_after(const std::string& text, const std::string& key) {
  const auto at = text.find(key);
  if (at == std::string::npos) return 0;
  auto start = at + key.size();
  while (start < text.size() && (text[start] == '"' || text[start] == ':' || text[start] == ' ' || text[start] == '\t'))
    ++start;
  return std::strtod(text.c_str() + start, nullptr);
}

namespace {

// Every command a Redis server runs, as MONITOR shows them, from a connection of its own.
class RedisMonitor {
 public:
  explicit RedisMonitor(const HostPort& where) : fd_(connect_to(where)) {
    if (fd_ < 0) return;
    const std::string command = "MONITOR\r\n";
    send(fd_, command.data(), command.size(), MSG_NOSIGNAL);
    reader_ = std::thread([this] {
      std::string pending;
      char buffer[65536];
      for (ssize_t n; (n = recv(fd_, buffer, sizeof buffer, 0)) > 0;) {
        pending.append(buffer, n);
        std::lock_guard lock(mutex_);
        for (std::size_t end; (end = pending.find("\r\n")) != std::string::npos; pending.erase(0, end + 2)) {
          lines_.push_back(pending.substr(0, end));
        }
      }
    });
  }
  ~RedisMonitor() {
    if (fd_ < 0) return;
    shutdown(fd_, SHUT_RDWR);
    reader_.join();
    close(fd_);
  }
  bool ok() const { return fd_ >= 0; }
  std::size_t size() {
    std::lock_guard lock(mutex_);
    return lines_.size();
  }
  // The lines from `from` on.
  std::vector<std::string> since(std::size_t from) {
    std::lock_guard lock(mutex_);
    return {lines_.begin() + std::min(from, lines_.size()), lines_.end()};
  }

 private:
  int fd_;
  std::mutex mutex_;
  std::vector<std::string> lines_;
  std::thread reader_;
};

// ---- what a release did, as one backend can count it ---------------------------------------

class ConsulCounter : public ServerCounter {
 public:
  explicit ConsulCounter(const std::string& url) : where_(host_port(url)) {}
  Counts snapshot() override {
    const auto stats = http_get(where_, "/v1/test-stand-in/stats");
    // A flat JSON object: requests answered by method and endpoint ("GET /v1/kv": N), blocking
    // queries by how they ended ("blocking woken": N).
    Counts counts;
    for (std::size_t at = 0; (at = stats.find('"', at)) != std::string::npos;) {
      const auto end = stats.find('"', at + 1);
      if (end == std::string::npos) break;
      const auto key = stats.substr(at + 1, end - at - 1);
      const double value = number_after(stats.substr(end), "\"");
      if (key.find(" /v1/") != std::string::npos) counts.requests += value;
      if (key == "blocking woken") counts.woken += value;
      at = end + 1;
    }
    return counts;
  }
  const char* woken_means() const override { return "blocking queries woken (stand-in stats)"; }
  const char* requests_mean() const override { return "HTTP requests (stand-in stats)"; }

 private:
  HostPort where_;
};

class EtcdCounter : public ServerCounter {
 public:
  explicit EtcdCounter(const std::string& url) : where_(host_port(url)) {}
  Counts snapshot() override {
    const auto metrics = http_get(where_, "/metrics");
    return {number_after(metrics, "\netcd_debugging_mvcc_events_total "),
            number_after(metrics, "\netcd_mvcc_range_total ")};
  }
  const char* woken_means() const override { return "watch events sent (etcd_debugging_mvcc_events_total)"; }
  const char* requests_mean() const override { return "ranges read (etcd_mvcc_range_total)"; }

 private:
  HostPort where_;
};

class ZooKeeperCounter : public ServerCounter {
 public:
  explicit ZooKeeperCounter(const std::string& url) : where_(host_port(url)) {}
  Counts snapshot() override {
    const auto mntr = ask(where_, "mntr");
    double fired = 0;
    for (const char* kind : {"created", "deleted", "changed", "children"}) {
      fired += number_after(mntr, std::string("zk_sum_node_") + kind + "_watch_count");
    }
    // Our own mntr connection is one packet received per snapshot: not the waiters'.
    return {fired, number_after(mntr, "zk_packets_received") - (snapshots_++)};
  }
  const char* woken_means() const override { return "watches triggered (mntr zk_sum_node_*_watch_count)"; }
  const char* requests_mean() const override { return "packets received (mntr zk_packets_received)"; }

 private:
  HostPort where_;
  double snapshots_ = 0;
};

// Redis: the waiters sleep on one subscriber connection per client and a script that admits
// someone publishes the admitted entries' seqs on the name's channel; only a waiter named looks
// again (the client's watchdog renews all its entries of the name in one script call a round,
// every min(2 s, TTL/3), regardless). Counted
// from MONITOR: the seqs named in the PUBLISHes on the name's channel after the snapshot, one
// wake-up each (this test's waiters share one client, so one receiver per message).
class RedisCounter : public ServerCounter {
 public:
  RedisCounter(const std::string& url, std::string name) : monitor_(host_port(url)), name_(std::move(name)) {}
  Counts snapshot() override { return {0, static_cast<double>(monitor_.size())}; }
  Counts since(const Counts& before) override {
    Counts counts;
    for (const auto& line : monitor_.since(static_cast<std::size_t>(before.requests))) {
      if (line.find(" lua]") == std::string::npos) {
        ++counts.requests;
      } else if (line.find("\"PUBLISH\"") != std::string::npos && line.find(name_) != std::string::npos) {
        // ... "PUBLISH" "<channel>" "<seq> <seq> ...": the last quoted argument.
        const auto open = line.rfind('"', line.size() - 2);
        std::istringstream seqs(line.substr(open + 1, line.size() - open - 2));
        for (std::string seq; seqs >> seq;) ++counts.woken;
      }
    }
    return counts;
  }
  const char* woken_means() const override { return "waiters named in PUBLISHes on the name's channel (MONITOR)"; }
  const char* requests_mean() const override { return "commands (MONITOR; waiters' periodic renew scripts included)"; }
  bool ok() const override { return monitor_.ok(); }

 private:
  RedisMonitor monitor_;
  std::string name_;
};

}  // namespace

std::unique_ptr<ServerCounter> server_counter(const std::string& url, const std::string& name) {
  const std::string scheme = url.substr(0, url.find(':'));
  if (scheme == "consul") return std::make_unique<ConsulCounter>(url);
  if (scheme == "etcd") return std::make_unique<EtcdCounter>(url);
  if (scheme == "zk") return std::make_unique<ZooKeeperCounter>(url);
  if (scheme == "redis") return std::make_unique<RedisCounter>(url, name);
  return nullptr;
}

std::string HerdPlan::problem(const std::string& url) const {
  if (!server && scheme != "file") return "no wake-up counter for " + url;
  if (server && !server->ok()) return "cannot count on " + url;
  return "";
}

HerdPlan herd_plan(const std::string& url, const std::string& name) {
  using namespace std::chrono_literals;
  HerdPlan plan;
  plan.scheme = url.substr(0, url.find(':'));
  plan.server = server_counter(url, name);
  // etcd: one key per lease and name (concurrency.Mutex's layout), so a client's own waiters
  // line up inside the client and one of them at a time waits on the server: each waiter has a
  // client of its own there (its memory then includes that client's).
  plan.client_per_waiter = plan.scheme == "etcd";
#if defined(__SANITIZE_ADDRESS__)
  // Under AddressSanitizer 1000 etcd clients (a gRPC channel and keep-alive stream each) do not
  // fit 2 cores: the holder's own keep-alives went unanswered and only ~300 queued in 30 s. The
  // plain build runs the thousand; this run checks the same wake-up with 200 clients.
  if (plan.client_per_waiter) plan.waiters = 200;
#endif
  // Each etcd client renews its lease every TTL/3 with a keep-alive and a linearizable read: at
  // the default 10 s, 1000 clients sent 300 of each a second, and on 2 cores the holder's went
  // unconfirmed for 9 s (its hold then counted as possibly lost; CI). At 60 s they send 50; the
  // wake-up measured does not depend on the TTL. Their async acquires need no more than one
  // pool thread each.
  if (plan.client_per_waiter) {
    plan.options.ttl = 60s;
    plan.options.async_threads = 1;
  }
  return plan;
}

// ---- this process's threads ----------------------------------------------------------------

pid_t this_thread_id() { return static_cast<pid_t>(syscall(SYS_gettid)); }

// A thread's voluntary context switches: one more each time it blocks (after running again).
long voluntary_switches(pid_t tid) {
  std::ifstream status("/proc/self/task/" + std::to_string(tid) + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("voluntary_ctxt_switches:", 0) == 0) return std::stol(line.substr(line.find(':') + 1));
  }
  return -1;
}

long rss_kib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(line.find(':') + 1));
  }
  return -1;
}

std::vector<pid_t> thread_ids() {
  std::vector<pid_t> ids;
  std::error_code error;
  for (std::filesystem::directory_iterator it("/proc/self/task", error), end; !error && it != end; it.increment(error))
    ids.push_back(static_cast<pid_t>(std::stol(it->path().filename().string())));
  return ids;
}

std::string thread_names() {
  std::map<std::string, int> names;
  for (const auto tid : thread_ids()) {
    std::ifstream comm("/proc/self/task/" + std::to_string(tid) + "/comm");
    std::string name;
    std::getline(comm, name);
    ++names[name];
  }
  std::string out;
  for (const auto& [name, count] : names) out += (out.empty() ? "" : ", ") + name + " x" + std::to_string(count);
  return out;
}

std::vector<long> switches_of(const std::vector<pid_t>& tids) {
  std::vector<long> counts;
  counts.reserve(tids.size());
  for (const auto tid : tids) counts.push_back(voluntary_switches(tid));
  return counts;
}

std::size_t changed_count(const std::vector<long>& before, const std::vector<long>& after) {
  std::size_t changed = 0;
  for (std::size_t i = 0; i < before.size() && i < after.size(); ++i) changed += before[i] != after[i];
  return changed;
}

Counts wait_until_quiet(const std::function<std::vector<long>()>& switches, ServerCounter* server,
                        std::vector<long>& last) {
  using namespace std::chrono_literals;
  last = switches();
  Counts server_last = server ? server->snapshot() : Counts{};
  for (int round = 0; round < 20; ++round) {
    std::this_thread::sleep_for(500ms);
    auto now = switches();
    const auto server_now = server ? server->snapshot() : Counts{};
    const bool quiet = now == last && server_now.woken == server_last.woken;
    last = std::move(now);
    server_last = server_now;
    if (quiet) break;
  }
  return server_last;
}

// (A holder's token may differ from its entry's, Consul's being the lock key's index: only the
// waiters are compared.)
std::string order_change(const turnstile::Inspection& queued, const turnstile::Inspection& after) {
  if (after.holders.size() != 1) return std::to_string(after.holders.size()) + " holders";
  if (after.waiters.size() + 1 != queued.waiters.size())
    return std::to_string(after.waiters.size()) + " waiters of " + std::to_string(queued.waiters.size());
  for (std::size_t i = 1; i < queued.waiters.size(); ++i) {
    if (after.waiters[i - 1].fencing_token != queued.waiters[i].fencing_token)
      return "waiter " + std::to_string(i) + " moved";
  }
  return "";
}

std::string joined(const std::vector<std::string>& lines) {
  if (lines.empty()) return "none";
  std::string text;
  for (const auto& line : lines) text += (text.empty() ? "" : "; ") + line;
  return text;
}

}  // namespace wakeups
