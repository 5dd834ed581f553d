// SPDX-License-Identifier: Apache-2.0
// The zk:// backend's benchmarks (bench/zookeeper_run.sh runs them all and prints the tables).
//
//   turnstile_bench_zookeeper uncontended (turnstile|raw|raw-data|raw-container|raw-noresolve) zk://127.0.0.1:PORT
//   [SECONDS]
//     Uncontended lock+unlock per second: turnstile's RecursiveMutex, or its limit, the same
//     three requests (create ephemeral-sequential, getChildren, delete) sent raw with the same
//     C client. Also the requests the server received per pair: the delta of mntr's
//     zk_packets_received over the timed loop (every client's packets, so run it alone; the
//     keeper's once-a-second ping and the C client's own pings are included), and the CPU
//     time per pair of this process and (when TURNSTILE_ZK_SERVER_PID is set) of the server.
//     raw-data / raw-container: the raw loop with turnstile's node data / also its container parent;
//     raw-noresolve: the raw loop with zoo_set_servers_resolution_delay(zh, -1).
//     Curator's InterProcessMutex, the peer, is ZookeeperCuratorBench.java, same server, same run.
//
//   turnstile_bench_zookeeper waiters zk://127.0.0.1:PORT [--procs 10] [--threads 100]
//     PROCS x THREADS turnstile Mutex waiters queue on one lock held by another process, then
//     go through it one by one. Reports the watches the server fired per release (from mntr's
//     zk_sum_node_{deleted,changed,created,children}_watch_count: a herd shows as ~N per release,
//     a chain as exactly 1), and client memory per waiter: VmRSS of the waiter processes
//     before and after their threads queued, minus what the same number of idle threads
//     (blocked in read(2)) cost, measured in the same processes just before; and again after
//     malloc_trim(0) in each waiter process (the glibc arenas keep the waiters' transient
//     buffers, a 64 KiB getData buffer and a 1000-name getChildren answer each).
//
// Prints one JSON object per run.
#include <zookeeper/zookeeper.h>

#include <arpa/inet.h>
#include <malloc.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <turnstile/turnstile.hpp>

namespace {
using Clock = std::chrono::steady_clock;

// "zk://host:port[/chroot]" -> "host:port"
std::string host_port(const std::string& url) {
  auto rest = url.substr(url.find("://") + 3);
  return rest.substr(0, rest.find('/'));
}

// The server's `mntr` four-letter command, as key -> value.
std::map<std::string, double> mntr(const std::string& url) {
  std::map<std::string, double> result;
  const auto hp = host_port(url);
  const auto colon = hp.rfind(':');
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(std::atoi(hp.substr(colon + 1).c_str())));
  inet_pton(AF_INET, hp.substr(0, colon).c_str(), &address.sin_addr);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    std::perror("mntr connect");
    std::exit(2);
  }
  if (write(fd, "mntr", 4) != 4) std::exit(2);
  std::string text;
  char buffer[4096];
  for (ssize_t n; (n = read(fd, buffer, sizeof buffer)) > 0;) text.append(buffer, static_cast<size_t>(n));
  close(fd);
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    const auto tab = line.find('\t');
    if (tab == std::string::npos) continue;
    result[line.substr(0, tab)] = std::atof(line.c_str() + tab + 1);
  }
  return result;
}

double get(std::map<std::string, double>& m, const char* key) {
  const auto it = m.find(key);
  return it == m.end() ? 0 : it->second;
}

// CPU seconds (user + system) this process used, all threads (the C client's included).
double own_cpu() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
}

// CPU seconds the server process used, when TURNSTILE_ZK_SERVER_PID names it (else 0).
double server_cpu() {
  const char* pid = std::getenv("TURNSTILE_ZK_SERVER_PID");
  if (!pid || !*pid) return 0;
  std::ifstream stat(std::string("/proc/") + pid + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  std::istringstream fields(text.substr(text.rfind(')') + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; fields >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::atof(field.c_str());  // utime, stime
    if (i == 15) break;
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

template <class Body>
int uncontended_loop(const std::string& mode, const std::string& url, double seconds, Body body) {
  for (int i = 0; i < 500; ++i) body();  // warm up (the server's JIT too)
  auto before = mntr(url);
  const double cpu_before = own_cpu(), server_before = server_cpu();
  const auto start = Clock::now();
  long count = 0;
  while (std::chrono::duration<double>(Clock::now() - start).count() < seconds) {
    body();
    ++count;
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  const double cpu = own_cpu() - cpu_before, server = server_cpu() - server_before;
  auto after = mntr(url);
  const double packets = get(after, "zk_packets_received") - get(before, "zk_packets_received");
  const auto n = static_cast<double>(count);
  std::printf(
      "{\"mode\":\"%s\",\"pairs\":%ld,\"per_second\":%.1f,\"packets_per_pair\":%.3f,\"client_cpu_us_per_pair\":%.1f,"
      "\"server_cpu_us_per_pair\":%.1f}\n",
      mode.c_str(), count, n / elapsed, packets / n, cpu / n * 1e6, server / n * 1e6);
  return 0;
}

int uncontended(const std::string& mode, const std::string& url, double seconds) {
  if (mode == "turnstile") {
    auto client = turnstile::Client::connect(url);
    auto mutex = client.recursive_mutex("bench/zk-uncontended");
    return uncontended_loop(mode, url, seconds, [&] {
      mutex.lock();
      mutex.unlock();
    });
  }
  zoo_set_debug_level(static_cast<ZooLogLevel>(0));
  zhandle_t* zh = zookeeper_init(host_port(url).c_str(), nullptr, 30000, nullptr, nullptr, 0);
  // "raw-noresolve": the raw loop without the C client's default re-resolution of the server
  // list (getaddrinfo, i.e. a netlink dump and /etc/hosts reads) on every socket poll.
  if (mode == "raw-noresolve") zoo_set_servers_resolution_delay(zh, -1);
  while (zoo_state(zh) != ZOO_CONNECTED_STATE) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  zoo_create(zh, "/bench", "", 0, &ZOO_OPEN_ACL_UNSAFE, 0, nullptr, 0);
  zoo_create(zh, "/bench/zk-raw", "", 0, &ZOO_OPEN_ACL_UNSAFE, 0, nullptr, 0);
  // "raw-data": the same loop with turnstile's node data (~60 bytes instead of 1);
  // "raw-container": that, under a container parent (as turnstile's) instead of a persistent one.
  std::string data = "x";
  if (mode == "raw-data" || mode == "raw-container") {
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    data = "turnstile pid=" + std::to_string(getpid()) + " host=" + host + " kind=exclusive";
  }
  const std::string parent = mode == "raw-container" ? "/bench/zk-raw-container" : "/bench/zk-raw";
  if (mode == "raw-container") zoo_create(zh, parent.c_str(), "", 0, &ZOO_OPEN_ACL_UNSAFE, ZOO_CONTAINER, nullptr, 0);
  const std::string prefix = parent + "/_c_00000000-0000-4000-8000-000000000000-lock-";
  const int rc = uncontended_loop(mode, url, seconds, [&] {
    char created[256];
    zoo_create(zh, prefix.c_str(), data.data(), static_cast<int>(data.size()), &ZOO_OPEN_ACL_UNSAFE,
               ZOO_EPHEMERAL_SEQUENTIAL, created, sizeof created);
    String_vector children{};
    zoo_get_children(zh, parent.c_str(), 0, &children);
    deallocate_String_vector(&children);
    zoo_delete(zh, created, -1);
  });
  zookeeper_close(zh);
  return rc;
}

// ---- waiters

long rss_kib(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atol(line.c_str() + 6);
  }
  return 0;
}

struct WaitShared {
  std::atomic<int> connected;     // waiter processes connected (holder included)
  std::atomic<int> idle_started;  // idle threads blocked
  std::atomic<int> queued;        // waiter threads about to call lock()
  std::atomic<int> acquired;      // waiter threads that held the lock
  std::atomic<int> failed;
  std::atomic<int> trimmed;  // waiter processes that ran malloc_trim(0)
};

std::vector<pid_t> spawned;  // the parent's children, killed when it gives up
struct WaitShared;
WaitShared* shared_area;

void wait_until(const std::atomic<int>& value, int target, double seconds, const char* what) {
  const auto until = Clock::now() + std::chrono::duration<double>(seconds);
  while (value.load() < target) {
    if (Clock::now() > until || (&value != &shared_area->failed && shared_area->failed.load())) {
      std::fprintf(stderr, "timed out waiting for %s (%d of %d)\n", what, value.load(), target);
      for (const pid_t pid : spawned) kill(pid, SIGKILL);
      std::exit(3);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

int waiters(const std::string& url, int procs, int threads) {
  auto* shared =
      new (mmap(nullptr, sizeof(WaitShared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0)) WaitShared{};
  shared_area = shared;
  // Pipes closed by the parent: idle (start idle threads), go (start waiters), release (holder
  // unlocks), done (idle threads end).
  int idle[2], go[2], release[2], done[2], trim[2];
  if (pipe(idle) || pipe(go) || pipe(release) || pipe(done) || pipe(trim)) return 2;
  const auto block_on = [](int fd) {
    char byte;
    while (read(fd, &byte, 1) > 0) {
    }
  };
  const char* name = "bench/zk-waiters";
  // The holder: takes the lock first, lets go when told.
  const pid_t holder = fork();
  if (holder == 0) {
    close(release[1]);  // every write end a child keeps would keep a read from ending
    close(idle[1]);
    close(go[1]);
    close(done[1]);
    close(trim[1]);
    auto client = turnstile::Client::connect(url);
    auto mutex = client.mutex(name);
    mutex.lock();
    shared->connected++;
    block_on(release[0]);
    mutex.unlock();
    std::_Exit(0);
  }
  spawned.push_back(holder);
  wait_until(shared->connected, 1, 30, "the holder");
  std::vector<pid_t> children;
  for (int p = 0; p < procs; ++p) {
    const pid_t pid = fork();
    if (pid == 0) {
      close(idle[1]);
      close(go[1]);
      close(done[1]);
      close(release[1]);
      close(trim[1]);
      try {
        auto client = turnstile::Client::connect(url);
        auto mutex = client.mutex(name);
        shared->connected++;
        block_on(idle[0]);
        std::vector<std::thread> idlers, workers;
        // Once queued, hands freed memory back (malloc_trim): what is left is what waiters keep.
        std::thread trimmer([&] {
          block_on(trim[0]);
          malloc_trim(0);
          shared->trimmed++;
        });
        for (int t = 0; t < threads; ++t) {
          idlers.emplace_back([&] {
            shared->idle_started++;
            block_on(done[0]);
          });
        }
        block_on(go[0]);
        for (int t = 0; t < threads; ++t) {
          workers.emplace_back([&] {
            try {
              shared->queued++;
              mutex.lock();
              shared->acquired++;
              mutex.unlock();
            } catch (const std::exception& e) {
              std::fprintf(stderr, "waiter: %s\n", e.what());
              shared->failed = 1;
            }
          });
        }
        for (auto& w : workers) w.join();
        for (auto& t : idlers) t.join();
        trimmer.join();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "waiter process: %s\n", e.what());
        shared->failed = 1;
        std::_Exit(1);
      }
      std::_Exit(0);
    }
    children.push_back(pid);
    spawned.push_back(pid);
  }
  close(idle[0]);
  close(go[0]);
  close(release[0]);
  close(done[0]);
  close(trim[0]);
  const int total = procs * threads;
  const auto rss = [&] {
    long sum = 0;
    for (const pid_t pid : children) sum += rss_kib(pid);
    return sum;
  };
  wait_until(shared->connected, procs + 1, 60, "the waiter processes");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const long rss_connected = rss();
  close(idle[1]);
  wait_until(shared->idle_started, total, 60, "the idle threads");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const long rss_idle = rss();
  auto before = mntr(url);
  const double watches_before = get(before, "zk_watch_count");
  close(go[1]);
  wait_until(shared->queued, total, 60, "the waiter threads");
  // Every waiter has a watch set once zk_watch_count has grown by one per waiter.
  const auto until = Clock::now() + std::chrono::seconds(120);
  double watches_queued = 0;
  for (;;) {
    auto now = mntr(url);
    watches_queued = get(now, "zk_watch_count") - watches_before;
    if (watches_queued >= total || Clock::now() > until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const long rss_queued = rss();
  close(trim[1]);
  wait_until(shared->trimmed, procs, 60, "malloc_trim");
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const long rss_trimmed = rss();
  if (const char* pause = std::getenv("TURNSTILE_BENCH_PAUSE")) {  // to look at the queued waiters
    std::fprintf(stderr, "queued; pausing %s s\n", pause);
    std::this_thread::sleep_for(std::chrono::duration<double>(std::atof(pause)));
  }
  const double nodes_queued = get(before, "zk_znode_count");
  auto fired_before = mntr(url);
  const auto fired_sum = [](std::map<std::string, double>& m) {
    return get(m, "zk_sum_node_deleted_watch_count") + get(m, "zk_sum_node_changed_watch_count") +
           get(m, "zk_sum_node_created_watch_count") + get(m, "zk_sum_node_children_watch_count");
  };
  const auto drain_start = Clock::now();
  close(release[1]);  // the holder unlocks: the waiters go through one by one
  int status = 0;
  waitpid(holder, &status, 0);
  wait_until(shared->acquired, total, 300, "the waiters to acquire");
  const double drain = std::chrono::duration<double>(Clock::now() - drain_start).count();
  auto fired_after = mntr(url);
  close(done[1]);
  int failed = shared->failed.load();
  for (const pid_t pid : children) {
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failed = 1;
  }
  const double fired = fired_sum(fired_after) - fired_sum(fired_before);
  const double deleted =
      get(fired_after, "zk_sum_node_deleted_watch_count") - get(fired_before, "zk_sum_node_deleted_watch_count");
  const double most_per_event = std::max({get(fired_after, "zk_max_node_deleted_watch_count"),
                                          get(fired_after, "zk_max_node_children_watch_count"),
                                          get(fired_after, "zk_max_node_changed_watch_count")});
  const double children_fired =
      get(fired_after, "zk_sum_node_children_watch_count") - get(fired_before, "zk_sum_node_children_watch_count");
  const int releases = total + 1;  // the holder's and every waiter's; the last has no one behind
  (void)nodes_queued;
  std::printf(
      "{\"mode\":\"waiters\",\"procs\":%d,\"threads\":%d,\"waiters\":%d,\"watches_while_queued\":%.0f,"
      "\"releases\":%d,\"watches_fired\":%.0f,\"deleted_watches_fired\":%.0f,\"children_watches_fired\":%.0f,"
      "\"fired_per_release_with_waiter\":%.4f,\"most_fired_by_one_event_since_start\":%.0f,\"drain_seconds\":%.3f,"
      "\"handoffs_per_second\":%.1f,"
      "\"rss_connected_kib\":%ld,\"rss_idle_kib\":%ld,\"rss_queued_kib\":%ld,"
      "\"rss_trimmed_kib\":%ld,\"waiter_kib_trimmed_minus_thread\":%.2f,\"idle_thread_kib\":%.2f,\"waiter_kib_with_"
      "thread\":%.2f,\"waiter_kib_minus_thread\":%.2f,\"failed\":%d}\n",
      procs, threads, total, watches_queued, releases, fired, deleted, children_fired, fired / total, most_per_event,
      drain, total / drain, rss_connected, rss_idle, rss_queued, rss_trimmed,
      static_cast<double>(rss_trimmed - rss_idle - (rss_idle - rss_connected)) / total,
      static_cast<double>(rss_idle - rss_connected) / total, static_cast<double>(rss_queued - rss_idle) / total,
      static_cast<double>(rss_queued - rss_idle - (rss_idle - rss_connected)) / total, failed);
  return failed;
}
}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "uncontended" && argc >= 4) {
    return uncontended(argv[2], argv[3], argc > 4 ? std::atof(argv[4]) : 5);
  }
  if (mode == "waiters" && argc >= 3) {
    int procs = 10, threads = 100;
    for (int i = 3; i + 1 < argc; i += 2) {
      if (!std::strcmp(argv[i], "--procs")) procs = std::atoi(argv[i + 1]);
      else if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(argv[i + 1]);
    }
    return waiters(argv[2], procs, threads);
  }
  std::fprintf(stderr,
               "usage: %s uncontended (turnstile|raw|raw-data|raw-container|raw-noresolve) zk://host:port [seconds]\n"
               "       %s waiters zk://host:port [--procs 10] [--threads 100]\n",
               argv[0], argv[0]);
  return 64;
}
