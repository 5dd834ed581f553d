// 1000 waiters on one name, one release: the release wakes exactly one waiter, on every backend
// (issue 14), counted where the waking happens — the server's own counters:
//   consul://    the test stand-in's blocking queries woken (GET /v1/test-stand-in/stats);
//   etcd://      watch events sent (etcd_debugging_mvcc_events_total on /metrics);
//   zk://        watches triggered (mntr: zk_sum_node_{created,deleted,changed,children}_watch_count);
//   redis://     the script calls the waiting client sends on the name after the release (MONITOR);
//   file://      no server: the waiting threads that ran again (their voluntary context switches
//                in /proc/self/task/TID/status; a thread that sleeps again after a wake-up counts).
// Beside it, every backend also reports the waiter threads woken in this process, the requests
// the server got after the release, and the client's memory per waiter (RSS before and after
// queuing, printed; only a generous sanity bound asserted).
#include <gtest/gtest.h>
#include <netdb.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include "conformance/support.hpp"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr std::size_t kThousand = 1000;

// ---- talking to the servers (loopback, plain sockets) -------------------------------------

struct HostPort {
  std::string host;
  std::string port;
};

// The first host:port of a test server's URL (scheme://[user@]host:port[,...][/...][?...]).
HostPort host_port(const std::string& url) {
  auto rest = url.substr(url.find("://") + 3);
  rest = rest.substr(0, rest.find_first_of("/?,"));
  if (const auto at = rest.rfind('@'); at != std::string::npos) rest = rest.substr(at + 1);
  const auto colon = rest.rfind(':');
  return {rest.substr(0, colon), rest.substr(colon + 1)};
}

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

std::string http_get(const HostPort& where, const std::string& path) {
  return ask(where, "GET " + path + " HTTP/1.0\r\nHost: " + where.host + "\r\n\r\n");
}

// The number after `key` (and the separator that follows it) in `text`, 0 when absent.
double number_after(const std::string& text, const std::string& key) {
  const auto at = text.find(key);
  if (at == std::string::npos) return 0;
  auto start = at + key.size();
  while (start < text.size() && (text[start] == '"' || text[start] == ':' || text[start] == ' ' || text[start] == '\t'))
    ++start;
  return std::strtod(text.c_str() + start, nullptr);
}

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

struct Counts {
  double woken = 0;     // waiters the server (or kernel) woke
  double requests = 0;  // requests the server got (what a woken waiter sends to look again)
};

// Counts server-side events between two snapshots: snapshot() returns the counters now;
// delta() what happened since a snapshot.
class ServerCounter {
 public:
  virtual ~ServerCounter() = default;
  virtual Counts snapshot() = 0;
  virtual Counts since(const Counts& before) {
    const auto now = snapshot();
    return {now.woken - before.woken, now.requests - before.requests};
  }
  virtual const char* woken_means() const = 0;
  virtual const char* requests_mean() const = 0;
};

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
  bool ok() const { return monitor_.ok(); }

 private:
  RedisMonitor monitor_;
  std::string name_;
};

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

// A joinable thread with a small stack (1000 of them: 256 KiB each is plenty for a lock call).
class SmallThread {
 public:
  explicit SmallThread(std::function<void()> body) : body_(std::make_unique<std::function<void()>>(std::move(body))) {
    pthread_attr_t attributes;
    pthread_attr_init(&attributes);
    pthread_attr_setstacksize(&attributes, 256 * 1024);
    started_ = pthread_create(&thread_, &attributes, &SmallThread::run, body_.get()) == 0;
    pthread_attr_destroy(&attributes);
  }
  SmallThread(const SmallThread&) = delete;
  SmallThread& operator=(const SmallThread&) = delete;
  ~SmallThread() { join(); }
  void join() {
    if (started_) pthread_join(thread_, nullptr);
    started_ = false;
  }
  bool started() const { return started_; }

 private:
  static void* run(void* body) {
    (*static_cast<std::function<void()>*>(body))();
    return nullptr;
  }
  std::unique_ptr<std::function<void()>> body_;
  pthread_t thread_{};
  bool started_ = false;
};

// ---- the test --------------------------------------------------------------------------------

class Wakeups : public conformance::Conformance {};

TEST_P(Wakeups, OneReleaseWakesOneOfAThousandWaiters) {
  const auto name = this->name("herd");
  std::unique_ptr<ServerCounter> server;
  const std::string scheme = url().substr(0, url().find(':'));
  if (scheme == "consul") server = std::make_unique<ConsulCounter>(url());
  if (scheme == "etcd") server = std::make_unique<EtcdCounter>(url());
  if (scheme == "zk") server = std::make_unique<ZooKeeperCounter>(url());
  if (scheme == "redis") {
    auto redis = std::make_unique<RedisCounter>(url(), name);
    ASSERT_TRUE(redis->ok()) << "no MONITOR connection to " << url();
    server = std::move(redis);
  }
  ASSERT_TRUE(server || scheme == "file") << "no wake-up counter for " << url();

  // etcd: one key per lease and name (concurrency.Mutex's layout), so a client's own waiters
  // line up inside the client and one of them at a time waits on the server: each waiter has a
  // client of its own there (its memory then includes that client's).
  const bool client_per_waiter = scheme == "etcd";
#if defined(__SANITIZE_ADDRESS__)
  // Under AddressSanitizer 1000 etcd clients (a gRPC channel and keep-alive stream each) do not
  // fit 2 cores: the holder's own keep-alives went unanswered and only ~300 queued in 30 s. The
  // plain build runs the thousand; this run checks the same wake-up with 200 clients.
  const std::size_t kWaiters = client_per_waiter ? 200 : kThousand;
#else
  const std::size_t kWaiters = kThousand;
#endif
  // Each etcd client renews its lease every TTL/3 with a keep-alive and a linearizable read: at
  // the default 10 s, 1000 clients sent 300 of each a second, and on 2 cores the holder's went
  // unconfirmed for 9 s (its hold then counted as possibly lost; CI). At 60 s they send 50; the
  // wake-up measured does not depend on the TTL.
  turnstile::ClientOptions options;
  if (client_per_waiter) options.ttl = 60s;
  std::optional<turnstile::Client> own_holder_client;
  if (client_per_waiter) own_holder_client.emplace(connect(options));
  auto& client = own_holder_client ? *own_holder_client : this->client();
  auto holder = client.mutex(name);
  holder.lock();
  const long rss_before = rss_kib();

  std::mutex mutex;
  std::condition_variable changed;
  std::vector<pid_t> tids(kWaiters, 0);
  std::vector<std::uint64_t> admitted;  // fencing tokens, in admission order
  bool measured = false;
  std::stop_source give_up;  // the waiters still queued once the measurement is over leave
  std::vector<std::unique_ptr<SmallThread>> threads;
  std::vector<std::string> errors;  // before drain: the threads it joins may still write here
  // However the test ends, the holder releases and the waiters pass the lock on and end.
  struct Drain {
    std::function<void()> run;
    ~Drain() { run(); }
  } drain{[&] {
    // Stop the waiters before the one admitted lets go: the other way round, the next in line
    // could be admitted in between (a second admission the test would count).
    give_up.request_stop();
    {
      std::lock_guard lock(mutex);
      measured = true;
    }
    changed.notify_all();
    if (holder.owns_lock()) holder.unlock();
    for (auto& thread : threads) thread->join();
  }};
  // In waves of 50, each queued before the next starts: 1000 joins at once would overrun a
  // server's listen backlog (the Consul stand-in's, Python's default of 5), and what is measured
  // is the release, not the joins.
  constexpr std::size_t kWave = 50;
  const auto queue_start = Clock::now();
  for (std::size_t i = 0; i < kWaiters; ++i) {
    threads.push_back(std::make_unique<SmallThread>([&, i] {
      {
        std::lock_guard lock(mutex);
        tids[i] = this_thread_id();
      }
      try {
        std::optional<turnstile::Client> own;
        if (client_per_waiter) own.emplace(connect(options));
        auto mine = (own ? *own : client).mutex(name);
        if (!mine.lock(give_up.get_token())) return;
        std::unique_lock lock(mutex);
        admitted.push_back(mine.fencing_token());
        changed.notify_all();
        // The one admitted holds until the measurement is over.
        changed.wait(lock, [&] { return measured; });
        lock.unlock();
        mine.unlock();
      } catch (const std::exception& error) {
        std::lock_guard lock(mutex);
        errors.push_back("waiter " + std::to_string(i) + ": " + error.what());
      }
    }));
    ASSERT_TRUE(threads.back()->started()) << "thread " << i;
    if ((i + 1) % kWave == 0 || i + 1 == kWaiters) {
      ASSERT_TRUE(wait_for_waiters(name, i + 1, 30s)) << "queued: " << waiter_count(name) << " of " << i + 1;
    }
  }
  const auto queue_time = Clock::now() - queue_start;
  const auto queued = client.inspect(name);
  ASSERT_EQ(queued.holders.size(), 1u);
  ASSERT_EQ(queued.waiters.size(), kWaiters);

  // Until every waiter sleeps: nothing changes in the threads' switches nor the server's
  // counters for half a second.
  const auto switches = [&] {
    std::vector<long> counts;
    for (auto tid : tids) counts.push_back(voluntary_switches(tid));
    return counts;
  };
  std::vector<long> before = switches();
  Counts server_before = server ? server->snapshot() : Counts{};
  for (int round = 0; round < 20; ++round) {
    std::this_thread::sleep_for(500ms);
    auto now = switches();
    const auto server_now = server ? server->snapshot() : Counts{};
    const bool quiet = now == before && server_now.woken == server_before.woken;
    before = std::move(now);
    server_before = server_now;
    if (quiet) break;
  }
  const long rss_queued = rss_kib();
  // ZooKeeper: each waiter watches the entry just ahead of it, so the server keeps one watched
  // path per waiter (wchs; the first waiter shares the holder's). Waiters watching the head
  // would all sleep on one path. All of this test's waiters share one session, so the server
  // fires one watch at the release either way (the count below cannot tell them apart): the
  // client then woke all thousand (issue 22), which the thread count below catches too.
  std::string watched = "(not ZooKeeper)";
  if (scheme == "zk") watched = ask(host_port(url()), "wchs");

  holder.unlock();
  {
    std::unique_lock lock(mutex);
    ASSERT_TRUE(changed.wait_for(lock, 20s, [&] { return !admitted.empty(); })) << "nobody admitted after the release";
  }
  std::this_thread::sleep_for(1s);  // room for any other waiter to wake
  const auto after = switches();
  const auto counts = server ? server->since(server_before) : Counts{};
  const auto held = client.inspect(name);

  std::size_t threads_woken = 0;
  for (std::size_t i = 0; i < kWaiters; ++i) threads_woken += after[i] != before[i];
  const double per_waiter_kib = static_cast<double>(rss_queued - rss_before) / kWaiters;
  std::printf("[ wakeups  ] %s: %zu waiters%s queued in %.1f s; one release woke %zu waiter thread(s) here",
              GetParam().label.c_str(), kWaiters, client_per_waiter ? " (a client each)" : "",
              std::chrono::duration<double>(queue_time).count(), threads_woken);
  if (server)
    std::printf("; server: %g %s, %g %s", counts.woken, server->woken_means(), counts.requests,
                server->requests_mean());
  std::printf("; client memory %.1f KiB per waiter (RSS %ld -> %ld KiB)\n", per_waiter_kib, rss_before, rss_queued);

  {
    std::lock_guard lock(mutex);
    EXPECT_EQ(admitted.size(), 1u) << "one release admits one waiter";
  }
  // The queue order is kept: the first queued left the line (to hold), the others wait in the
  // same order. (A holder's token may differ from its entry's: Consul's is the lock key's index.)
  ASSERT_EQ(held.holders.size(), 1u);
  ASSERT_EQ(held.waiters.size(), kWaiters - 1);
  for (std::size_t i = 1; i < kWaiters; ++i) {
    ASSERT_EQ(held.waiters[i - 1].fencing_token, queued.waiters[i].fencing_token) << "waiter " << i << " moved";
  }
  if (server) {
    // Exactly one: a herd would show here as hundreds, and a waiter woken for nothing (consul://
    // once woke the admitted waiter's successor: its hold rewrote the entry key that successor
    // blocks on) as 2.
    EXPECT_EQ(counts.woken, 1) << server->woken_means();
  } else {
    // file://: the kernel wakes the one F_OFD_SETLKW on the released byte (a watch thread), which
    // wakes the one waiter listening to it.
    EXPECT_EQ(threads_woken, 1u) << "waiter threads that ran after the release";
  }
  if (scheme == "zk") {
    // A waiter sleeps until the event on the one node it watches (no poll): one thread runs.
    EXPECT_EQ(threads_woken, 1u) << "waiter threads that ran after the release";
    EXPECT_GE(number_after(watched, "connections watching"), static_cast<double>(kWaiters))
        << "paths watched while the thousand waited (wchs): " << watched;
  }
#if defined(__SANITIZE_ADDRESS__)
  // AddressSanitizer's shadow memory and quarantine inflate RSS 2-10 times: printed above, not judged.
#else
  EXPECT_LT(per_waiter_kib, 1024.0) << "client memory per waiter";
#endif

  drain.run();
  EXPECT_EQ(admitted.size(), 1u) << "admitted before the others left";
  for (const auto& error : errors) ADD_FAILURE() << error;
  for (std::size_t i = 1; i < admitted.size(); ++i) EXPECT_LT(admitted[i - 1], admitted[i]) << "admission " << i;
}

INSTANTIATE_TEST_SUITE_P(Backends, Wakeups, ::testing::ValuesIn(conformance::backend_params()),
                         conformance::param_label);

}  // namespace
