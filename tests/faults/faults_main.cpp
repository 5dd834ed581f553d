// turnstile-faults: a Jepsen-style run of turnstile under injected faults (issue 14).
//
//   turnstile-faults run --backend LABEL --url URL | --server SCRIPT  --work DIR
//        [--seconds S] [--min-holds N] [--clients N] [--cli-clients N] [--ttl-ms MS]
//        [--faults server-kill,server-pause,client-pause,client-kill,partition,client-partition]
//        [--netns PREFIX --netns-script tests/servers/netns.sh]
//        [--cli PATH] [--table FILE] [--allow-overlaps REASON] [--url-query K=V]
//
// It starts the servers (SCRIPT start DIR; a cluster script also writes DIR/nodes), starts the
// clients (fault_worker.cpp), injects one fault after another while they work, stops them,
// waits for their leases to run out, and checks what happened:
//   * the hold histories with the shared checker (two holders believed at once, a Semaphore
//     over its limit, fencing tokens out of order);
//   * stale writes the fenced store accepted (a write of a hold after a newer hold began);
//   * entries left behind once every client is gone and the TTL has passed (Client::inspect);
//   * waiters that timed out although the name was free for longer than the bound while no
//     fault was active;
// and prints a table row: holds, faults by kind, the above, loss-report latency, availability.
// Exit status 0 when nothing was found, 1 when something was, 2 on a usage or set-up error.
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fault_log.hpp"
#include "fault_worker.hpp"
#include "testing/hold_history.hpp"
#include "turnstile/turnstile.hpp"

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using turnstile::testing::monotonic_ns;

namespace turnstile::faults {
namespace {

// SIGTERM, SIGINT or SIGHUP: end the run early, through the normal clean-up (clients stopped,
// servers stopped, network namespaces deleted); the checks still run on what was recorded.
volatile std::sig_atomic_t g_interrupted = 0;
void on_interrupt(int) { g_interrupted = 1; }
void catch_interrupts() {
  struct sigaction action {};
  action.sa_handler = on_interrupt;
  sigemptyset(&action.sa_mask);
  for (const int signal : {SIGTERM, SIGINT, SIGHUP}) ::sigaction(signal, &action, nullptr);
}

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "turnstile-faults: " << why << "\n"
            << "usage: turnstile-faults run --backend LABEL (--url URL | --server SCRIPT) --work DIR [options]\n";
  std::exit(2);
}

std::string shell_quote(const std::string& text) {
  std::string out = "'";
  for (const char c : text) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Runs a shell command; its standard output, and whether it exited 0.
std::pair<bool, std::string> run_command(const std::string& command) {
  std::string output;
  FILE* pipe = ::popen((command + " 2>>/dev/null").c_str(), "r");
  if (!pipe) return {false, ""};
  char buffer[4096];
  while (const auto got = std::fread(buffer, 1, sizeof buffer, pipe)) output.append(buffer, got);
  const int status = ::pclose(pipe);
  return {WIFEXITED(status) && WEXITSTATUS(status) == 0, output};
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  auto value = text.str();
  while (!value.empty() && (value.back() == '\n' || value.back() == ' ')) value.pop_back();
  return value;
}

// The servers of a run, driven through their test script: one node (SCRIPT restart DIR, the
// pid file) or a cluster (SCRIPT kill/start-node/pause/resume/leader DIR ID, DIR/nodes).
class Servers {
 public:
  Servers(std::string script, std::string dir) : script_(std::move(script)), dir_(std::move(dir)) {}
  ~Servers() {
    for (const auto& id : paused_) resume(id);
    if (started_) run_command(shell_quote(script_) + " stop " + shell_quote(dir_));
  }

  std::string start() {
    started_ = true;  // a start that fails halfway is stopped too
    const auto [ok, output] = run_command(shell_quote(script_) + " start " + shell_quote(dir_) + " >&2");
    if (!ok) throw std::runtime_error("could not start the servers with " + script_);
    if (fs::exists(fs::path(dir_) / "nodes")) {
      std::istringstream nodes(read_file(fs::path(dir_) / "nodes"));
      std::string line;
      while (std::getline(nodes, line)) {
        std::istringstream fields(line);
        std::string id;
        if (fields >> id) ids_.push_back(id);
      }
    } else {
      ids_.push_back("1");
      for (const auto& entry : fs::directory_iterator(dir_)) {
        if (entry.path().extension() == ".pid") pid_file_ = entry.path();
      }
      if (pid_file_.empty()) throw std::runtime_error("no pid file in " + dir_);
    }
    // The Consul stand-in writes the URL with its test query (lock_delay) as turnstile_url.
    const auto with_query = fs::path(dir_) / "turnstile_url";
    return read_file(fs::exists(with_query) ? with_query : fs::path(dir_) / "url");
  }

  bool cluster() const { return pid_file_.empty(); }
  const std::vector<std::string>& ids() const { return ids_; }

  // The node a fault should hit: the leader every other time, a follower otherwise.
  std::string pick(std::mt19937_64& random, bool leader) {
    if (!cluster()) return ids_.front();
    if (leader) {
      const auto [ok, output] = run_command(shell_quote(script_) + " leader " + shell_quote(dir_));
      std::istringstream fields(output);
      std::string id;
      if (ok && (fields >> id)) return id;
    }
    return ids_[random() % ids_.size()];
  }

  void kill(const std::string& id) {
    if (cluster()) {
      node_command("kill", id);
    } else {
      signal_pid(SIGKILL);
    }
  }
  void restart(const std::string& id, bool wipe) {
    if (cluster()) {
      node_command("start-node", id, wipe ? " wipe" : "");
    } else {
      run_command(shell_quote(script_) + " restart " + shell_quote(dir_) + " >&2");
    }
  }
  void pause(const std::string& id) {
    paused_.insert(id);
    if (cluster()) {
      node_command("pause", id);
    } else {
      signal_pid(SIGSTOP);
    }
  }
  void resume(const std::string& id) {
    paused_.erase(id);
    if (cluster()) {
      node_command("resume", id);
    } else {
      signal_pid(SIGCONT);
    }
  }

 private:
  void node_command(const std::string& verb, const std::string& id, const std::string& extra = "") {
    run_command(shell_quote(script_) + " " + verb + " " + shell_quote(dir_) + " " + shell_quote(id) + extra + " >&2");
  }
  void signal_pid(int signal) {
    const auto pid = read_file(pid_file_);
    if (!pid.empty()) ::kill(std::stoi(pid), signal);
  }

  std::string script_;
  std::string dir_;
  bool started_ = false;
  std::vector<std::string> ids_;
  fs::path pid_file_;
  std::set<std::string> paused_;
};

// Network namespaces for partitions (tests/servers/netns.sh), made for the run and deleted
// after it. Enters the clients' namespace: call before any thread starts.
class NetworkNamespaces {
 public:
  static constexpr int kServers = 3;
  static constexpr int kClients = 4;  // the namespace of this process and its clients
  NetworkNamespaces(std::string script, std::string prefix) : script_(std::move(script)), prefix_(std::move(prefix)) {
    if (!run_command(shell_quote(script_) + " up " + shell_quote(prefix_) + " " + std::to_string(kClients) + " >&2").first) {
      throw std::runtime_error("could not make the network namespaces (root and `ip netns` are needed)");
    }
    std::string names, hosts;
    for (int i = 1; i <= kServers; ++i) {
      names += (i > 1 ? " " : "") + prefix_ + "-" + std::to_string(i);
      hosts += (i > 1 ? " " : "") + address(i);
    }
    ::setenv("TURNSTILE_CLUSTER_NETNS", names.c_str(), 1);
    ::setenv("TURNSTILE_CLUSTER_HOSTS", hosts.c_str(), 1);
    const auto path = "/run/netns/" + prefix_ + "-" + std::to_string(kClients);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) throw std::runtime_error("cannot enter " + path);
    ::close(fd);
  }
  ~NetworkNamespaces() { run_command(shell_quote(script_) + " down " + shell_quote(prefix_)); }
  void cut(const std::string& id) { run_command(shell_quote(script_) + " cut " + shell_quote(prefix_) + " " + shell_quote(id)); }
  void heal(const std::string& id) { run_command(shell_quote(script_) + " heal " + shell_quote(prefix_) + " " + shell_quote(id)); }
  static std::string address(int i) { return "10.213.0." + std::to_string(10 + i); }

 private:
  std::string script_;
  std::string prefix_;
};

struct RunOptions {
  std::string backend;
  std::string url;
  std::string server_script;
  std::string work_dir;
  std::chrono::seconds seconds{30};
  std::size_t min_holds = 0;
  int clients = 4;
  int cli_clients = 1;
  std::chrono::milliseconds ttl{2000};
  std::vector<std::string> fault_kinds;
  std::string netns_prefix;  // partitions: nodes and clients in namespaces netns_script made
  std::string netns_script;
  std::string cli_path;
  std::string table_path;
  std::string allow_overlaps;  // why overlaps are the engine's documented behaviour, or empty
  bool clients_ignore_loss = false;
  std::string url_query;  // appended to the servers' URL, e.g. min_replicas=1
};

struct FaultWindow {
  std::string kind;
  std::int64_t start_ns = 0;
  std::int64_t end_ns = 0;
};

// The client processes, started again when a fault kills one.
class Clients {
 public:
  Clients(const RunOptions& run, WorkerOptions base, std::string self) : run_(run), base_(std::move(base)), self_(std::move(self)) {}
  ~Clients() {
    for (auto& [pid, info] : live_) {
      ::kill(pid, SIGCONT);
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }

  void start_all() {
    for (int i = 0; i < run_.clients; ++i) spawn(next_id_++, false);
    for (int i = 0; i < run_.cli_clients; ++i) spawn(next_id_++, true);
  }

  // A library client at random (the ones that hold through the library, for pauses and kills).
  std::optional<pid_t> pick_library_client(std::mt19937_64& random) {
    std::vector<pid_t> candidates;
    for (const auto& [pid, cli] : live_) {
      if (!cli) candidates.push_back(pid);
    }
    if (candidates.empty()) return std::nullopt;
    return candidates[random() % candidates.size()];
  }

  // A library client that holds one of `names` now (the Kleppmann pause hits a holder), else
  // any library client.
  std::optional<pid_t> pick_holder(const std::string& url, std::vector<std::string> names, std::mt19937_64& random) {
    std::shuffle(names.begin(), names.end(), random);
    // Mutexes first: a paused exclusive holder is the case fencing exists for.
    std::stable_partition(names.begin(), names.end(), [](const std::string& name) { return name.find("/mutex") != std::string::npos; });
    try {
      ClientOptions options;
      options.connect_timeout = 2s;
      auto client = Client::connect(url, options);
      for (const auto& name : names) {
        for (const auto& holder : client.inspect(name, SteadyClock::now() + 1s).holders) {
          const auto it = live_.find(static_cast<pid_t>(holder.pid));
          if (it != live_.end() && !it->second) return it->first;
        }
      }
    } catch (const Error&) {
      // The server may be down: any client will do.
    }
    return pick_library_client(random);
  }

  void kill_and_replace(pid_t pid) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    const bool cli = live_[pid];
    live_.erase(pid);
    spawn(next_id_++, cli);
  }

  // SIGTERM to all; each leaves its queue and exits within its acquire bound. Returns how many
  // had to be killed.
  int stop_all(std::chrono::milliseconds grace) {
    for (const auto& [pid, cli] : live_) ::kill(pid, SIGTERM);
    const auto until = std::chrono::steady_clock::now() + grace;
    int killed = 0;
    while (!live_.empty()) {
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid > 0) {
        live_.erase(pid);
        continue;
      }
      if (std::chrono::steady_clock::now() > until) {
        for (const auto& [left, cli] : live_) {
          ::kill(left, SIGKILL);
          ::waitpid(left, nullptr, 0);
          ++killed;
        }
        live_.clear();
        break;
      }
      std::this_thread::sleep_for(20ms);
    }
    return killed;
  }

  // Clients that exited on their own (a crash), reaped and started again.
  int reap_and_restart() {
    int crashed = 0;
    for (;;) {
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) break;
      const auto it = live_.find(pid);
      if (it == live_.end()) continue;
      const bool cli = it->second;
      live_.erase(it);
      std::cerr << "client " << pid << " exited by itself (status " << status << "); starting another\n";
      ++crashed;
      spawn(next_id_++, cli);
    }
    return crashed;
  }

 private:
  void spawn(int id, bool cli) {
    auto options = base_;
    options.id = id;
    options.seed = base_.seed * 1000003 + static_cast<std::uint64_t>(id);
    std::vector<std::string> args;
    args.insert(args.end(), {self_, cli ? "cli-worker" : "worker", options.url, std::to_string(options.ttl.count()),
                             std::to_string(options.acquire_timeout.count()), options.prefix,
                             std::to_string(options.names_per_kind), options.out_dir, options.store_dir,
                             std::to_string(options.id), std::to_string(options.seed), run_.cli_path,
                             options.ignore_loss ? "ignore-loss" : "check-loss"});
    const pid_t pid = ::fork();
    if (pid == 0) {
      std::vector<char*> argv;
      for (auto& arg : args) argv.push_back(arg.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    live_[pid] = cli;
  }

  const RunOptions& run_;
  WorkerOptions base_;
  std::string self_;
  int next_id_ = 1;
  std::map<pid_t, bool> live_;  // pid -> is a CLI client
};

std::size_t count_lines(const fs::path& dir, const std::string& extension) {
  std::size_t lines = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != extension) continue;
    std::ifstream in(entry.path());
    lines += static_cast<std::size_t>(std::count(std::istreambuf_iterator<char>(in), {}, '\n'));
  }
  return lines;
}

std::int64_t percentile(std::vector<std::int64_t> values, double p) {
  if (values.empty()) return -1;
  std::sort(values.begin(), values.end());
  const auto index = static_cast<std::size_t>(p * static_cast<double>(values.size() - 1) + 0.5);
  return values[std::min(index, values.size() - 1)];
}

// Length of the union of intervals, clipped to [from, to).
using Interval = std::pair<std::int64_t, std::int64_t>;
std::vector<Interval> merge(std::vector<Interval> intervals) {
  std::sort(intervals.begin(), intervals.end());
  std::vector<Interval> merged;
  for (const auto& interval : intervals) {
    if (!merged.empty() && interval.first <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, interval.second);
    } else {
      merged.push_back(interval);
    }
  }
  return merged;
}
std::int64_t covered(const std::vector<Interval>& merged, std::int64_t from, std::int64_t to) {
  std::int64_t total = 0;
  for (const auto& [a, b] : merged) total += std::max<std::int64_t>(0, std::min(b, to) - std::max(a, from));
  return total;
}

// The longest stretch of [from, to) covered by none of `busy` (merged intervals).
std::int64_t longest_gap(const std::vector<Interval>& busy, std::int64_t from, std::int64_t to) {
  std::int64_t longest = 0;
  std::int64_t cursor = from;
  for (const auto& [a, b] : busy) {
    if (b <= cursor) continue;
    if (a >= to) break;
    longest = std::max(longest, std::min(a, to) - cursor);
    cursor = std::max(cursor, b);
  }
  return std::max(longest, to - cursor);
}

// Entries left on the run's names: polls until none are left or `patience` ran out.
std::size_t leaked_entries(const std::string& url, const std::vector<std::string>& names, std::chrono::milliseconds ttl,
                           std::chrono::milliseconds patience) {
  const auto until = std::chrono::steady_clock::now() + patience;
  std::size_t left = 0;
  for (;;) {
    left = 0;
    try {
      ClientOptions options;
      options.ttl = ttl;
      options.connect_timeout = 3s;
      auto client = Client::connect(url, options);
      for (const auto& name : names) {
        const auto seen = client.inspect(name, SteadyClock::now() + 3s);
        left += seen.holders.size() + seen.waiters.size();
      }
    } catch (const Error& error) {
      std::cerr << "inspect: " << error.what() << "\n";
      left = static_cast<std::size_t>(-1);
    }
    if (left == 0 || std::chrono::steady_clock::now() > until) return left == static_cast<std::size_t>(-1) ? names.size() : left;
    std::this_thread::sleep_for(500ms);
  }
}

// After a fault, the time the engines need to recover (a dead lease runs out, a new leader is
// elected): waits and gaps inside it are not starvation.
std::int64_t recovery_ns_for(std::chrono::milliseconds ttl) { return std::chrono::nanoseconds(2 * ttl + 3s).count(); }

int run(const RunOptions& options, const std::string& self) {
  // The work directory is this tool's: an earlier run's (its marker) or a new one. An earlier
  // run's servers, left by a crash, are stopped before their pid files go.
  const auto marker = fs::path(options.work_dir) / ".turnstile-faults";
  const bool earlier_run = fs::exists(marker) || fs::exists(fs::path(options.work_dir) / "faults.log");
  if (fs::exists(options.work_dir) && !fs::is_empty(options.work_dir) && !earlier_run) {
    throw std::runtime_error(options.work_dir + " is not empty and not a fault run's work directory: not removing it");
  }
  if (!options.server_script.empty() && fs::exists(fs::path(options.work_dir) / "servers")) {
    run_command(shell_quote(options.server_script) + " stop " + shell_quote((fs::path(options.work_dir) / "servers").string()));
  }
  fs::remove_all(options.work_dir);
  fs::create_directories(options.work_dir);
  std::ofstream(marker) << "a turnstile-faults work directory\n";
  fs::create_directories(fs::path(options.work_dir) / "clients");
  const auto clients_dir = (fs::path(options.work_dir) / "clients").string();
  // Partitions: servers in namespaces PREFIX-1..3, this process and its clients in PREFIX-4,
  // all joined by a bridge that netns.sh cuts one link of.
  std::optional<NetworkNamespaces> namespaces;
  if (!options.netns_prefix.empty()) {
    if (::geteuid() == 0) {
      namespaces.emplace(options.netns_script, options.netns_prefix);
    } else {
      std::cerr << "faults: not root: no network namespaces, so no partitions in this run\n";
    }
  }
  std::optional<Servers> servers;
  std::string url = options.url;
  if (!options.server_script.empty()) {
    servers.emplace(options.server_script, (fs::path(options.work_dir) / "servers").string());
    url = servers->start();
  }
  if (!options.url_query.empty()) url += (url.find('?') == std::string::npos ? "?" : "&") + options.url_query;
  std::cerr << "faults: " << options.backend << " on " << url << "\n";
  std::random_device seed_source;
  const std::uint64_t seed = (static_cast<std::uint64_t>(seed_source()) << 32) | seed_source();
  std::mt19937_64 random(seed);
  WorkerOptions base;
  base.url = url;
  base.ttl = options.ttl;
  base.acquire_timeout = std::max<std::chrono::milliseconds>(4 * options.ttl + 4s, 10s);
  base.prefix = "faults/" + std::to_string(::getpid()) + "-" + std::to_string(seed % 100000);
  base.names_per_kind = 2;
  base.out_dir = clients_dir;
  base.store_dir = (fs::path(options.work_dir) / "store").string();
  base.seed = seed;
  base.ignore_loss = options.clients_ignore_loss;
  FencedStore store(base.store_dir);

  EventLog fault_log((fs::path(options.work_dir) / "faults.log").string());  // kind start_ns end_ns
  Clients clients(options, base, self);
  clients.start_all();
  std::vector<FaultWindow> faults;
  std::map<std::string, int> fault_counts;
  int crashed = 0;
  const auto started = std::chrono::steady_clock::now();
  const std::int64_t run_start_ns = monotonic_ns();
  std::size_t next_kind = 0;
  bool hit_leader = true;
  bool wipe = false;
  auto calm = [&](std::chrono::milliseconds length) {
    const auto until = std::chrono::steady_clock::now() + length;
    while (std::chrono::steady_clock::now() < until && !g_interrupted) {
      crashed += clients.reap_and_restart();
      std::this_thread::sleep_for(50ms);
    }
  };
  for (;;) {
    calm(std::chrono::milliseconds(1000 + random() % 1500));
    if (g_interrupted) {
      std::cerr << "faults: interrupted; stopping the run\n";
      break;
    }
    if (crashed > 20) {
      std::cerr << "faults: clients keep exiting by themselves; stopping the run\n";
      break;
    }
    const bool time_up = std::chrono::steady_clock::now() - started >= options.seconds;
    if (time_up && count_lines(clients_dir, ".history") >= options.min_holds) break;
    if (options.fault_kinds.empty()) continue;
    const auto kind = options.fault_kinds[next_kind++ % options.fault_kinds.size()];
    FaultWindow window{kind, monotonic_ns(), 0};
    if (kind == "server-kill" && servers) {
      const auto id = servers->pick(random, hit_leader);
      hit_leader = !hit_leader;
      servers->kill(id);
      calm(std::chrono::milliseconds(500 + random() % 1500));
      servers->restart(id, servers->cluster() && (wipe = !wipe));
    } else if (kind == "server-pause" && servers) {
      const auto id = servers->pick(random, hit_leader);
      hit_leader = !hit_leader;
      servers->pause(id);
      calm(options.ttl + 1s);
      servers->resume(id);
    } else if (kind == "client-pause") {
      if (const auto pid = clients.pick_holder(url, run_names(base.prefix, base.names_per_kind), random)) {
        ::kill(*pid, SIGSTOP);
        calm(2 * options.ttl + 500ms);  // past its TTL: others are admitted meanwhile
        ::kill(*pid, SIGCONT);
      }
    } else if (kind == "client-kill") {
      if (const auto pid = clients.pick_library_client(random)) clients.kill_and_replace(*pid);
    } else if (kind == "partition" && servers && servers->cluster() && namespaces) {
      // One server node cut off from the others and from every client, past the TTL.
      const auto id = servers->pick(random, hit_leader);
      hit_leader = !hit_leader;
      namespaces->cut(id);
      calm(options.ttl + 1s);
      namespaces->heal(id);
    } else if (kind == "client-partition" && namespaces && servers && servers->cluster()) {
      // (A single node runs in the clients' own namespace: cutting it off would change nothing.)
      // Every client cut off from every server past the TTL: each holder must be told.
      namespaces->cut(std::to_string(NetworkNamespaces::kClients));
      calm(options.ttl + 1s);
      namespaces->heal(std::to_string(NetworkNamespaces::kClients));
    } else {
      continue;  // a kind this run cannot inject
    }
    window.end_ns = monotonic_ns();
    fault_log.line(kind + " " + std::to_string(window.start_ns) + " " + std::to_string(window.end_ns));
    faults.push_back(window);
    ++fault_counts[kind];
  }
  // A calm tail longer than an acquire's bound: a waiter left stuck by a fault (a lost wake-up)
  // times out in it, with the name free and no fault near, and is reported starved.
  if (!g_interrupted) {
    calm(base.acquire_timeout + std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::nanoseconds(recovery_ns_for(options.ttl))) + 1s);
  }
  const std::int64_t run_end_ns = monotonic_ns();
  const int stuck = clients.stop_all(base.acquire_timeout + 5s);

  // Every client is gone: its entries must go within the TTL rules (a killed client's lease
  // runs out; ZooKeeper's session, etcd's lease, Redis' TTL, Consul's TTL x 2).
  const auto names = run_names(base.prefix, base.names_per_kind);
  const std::size_t leaked = leaked_entries(url, names, options.ttl, 4 * options.ttl + 5s);

  // The checks.
  std::vector<testing::HoldRecord> records;
  for (const auto& entry : fs::directory_iterator(clients_dir)) {
    if (entry.path().extension() != ".history") continue;
    auto part = testing::load_history(entry.path().string());
    records.insert(records.end(), part.begin(), part.end());
  }
  const auto violations = testing::check(records, [](const std::string& name) -> std::int64_t {
    return is_semaphore_name(name) ? kSemaphoreLimit : 0;
  });
  const auto events = load_events(clients_dir);

  // Stale writes: accepted after a hold with a greater token had begun on the name.
  std::map<std::string, std::vector<std::pair<std::int64_t, std::uint64_t>>> exclusive_starts;
  for (const auto& record : records) {
    if (record.kind == "exclusive") exclusive_starts[record.name].emplace_back(record.start_ns, record.token);
  }
  for (auto& [name, starts] : exclusive_starts) std::sort(starts.begin(), starts.end());
  std::size_t stale = 0, writes = 0, rejected = 0;
  for (const auto& event : events) {
    if (event.type != "write") continue;
    ++writes;
    if (!event.accepted) {
      ++rejected;
      continue;
    }
    for (const auto& [start, token] : exclusive_starts[event.name]) {
      if (start >= event.a_ns) break;
      if (token > event.token) {
        ++stale;
        std::cerr << "stale write accepted: " << event.name << " token " << event.token << " at " << event.a_ns
                  << " after token " << token << " began at " << start << "\n";
        break;
      }
    }
  }

  // Fault windows, each followed by the time the engines need to recover (a dead lease runs
  // out, a new leader is elected): waits and gaps inside them are not starvation.
  const std::int64_t recovery_ns = recovery_ns_for(options.ttl);
  std::vector<Interval> fault_spans, recovering;
  for (const auto& fault : faults) {
    fault_spans.emplace_back(fault.start_ns, fault.end_ns);
    recovering.emplace_back(fault.start_ns, fault.end_ns + recovery_ns);
  }
  fault_spans = merge(fault_spans);
  recovering = merge(recovering);
  std::map<std::string, std::vector<Interval>> held;
  for (const auto& record : records) held[record.name].emplace_back(record.start_ns, record.end_ns);
  for (auto& [name, intervals] : held) intervals = merge(intervals);

  // Starved waiters: timed out although the name was free, with no fault near, for longer
  // than the bound (a lease of a client that just released runs out within 2 x TTL).
  const std::int64_t free_bound_ns = std::chrono::nanoseconds(2 * options.ttl + 2s).count();
  std::size_t starved = 0, timeouts = 0;
  for (const auto& event : events) {
    if (event.type != "timeout") continue;
    ++timeouts;
    auto busy = held[event.name];
    busy.insert(busy.end(), recovering.begin(), recovering.end());
    busy = merge(busy);
    if (longest_gap(busy, event.a_ns, event.b_ns) > free_bound_ns) {
      ++starved;
      std::cerr << "starved waiter on " << event.name << ": waited " << (event.b_ns - event.a_ns) / 1000000
                << " ms, the name free with no fault for " << longest_gap(busy, event.a_ns, event.b_ns) / 1000000
                << " ms\n";
    }
  }

  // Loss-report latency: from the start of the fault that caused it to the notice.
  std::vector<std::int64_t> loss_latency_ms;
  std::size_t losses = 0;
  for (const auto& event : events) {
    if (event.type != "lost") continue;
    ++losses;
    std::int64_t cause = 0;
    for (const auto& fault : faults) {
      if (fault.start_ns <= event.b_ns && fault.start_ns > cause) cause = fault.start_ns;
    }
    if (cause != 0) loss_latency_ms.push_back((event.b_ns - std::max(cause, event.a_ns)) / 1000000);
  }

  // Availability: the share of the faults' time in which a name was held, over the names.
  const std::int64_t fault_time = covered(fault_spans, run_start_ns, run_end_ns);
  double available_in_faults = 0, available_overall = 0;
  for (const auto& name : names) {
    const auto& intervals = held[name];
    available_overall += static_cast<double>(covered(intervals, run_start_ns, run_end_ns)) /
                         static_cast<double>(run_end_ns - run_start_ns);
    if (fault_time > 0) {
      std::int64_t during = 0;
      for (const auto& [a, b] : fault_spans) during += covered(intervals, a, b);
      available_in_faults += static_cast<double>(during) / static_cast<double>(fault_time);
    }
  }
  available_in_faults /= static_cast<double>(names.size());
  available_overall /= static_cast<double>(names.size());
  std::size_t errors = 0;
  for (const auto& event : events) errors += event.type == "error";

  std::ostringstream kinds;
  for (const auto& [kind, count] : fault_counts) kinds << (kinds.tellp() > 0 ? " " : "") << kind << "=" << count;
  // --allow-overlaps excuses what the engine documents (holds that overlap), nothing else.
  std::size_t unexplained = 0;
  for (const auto& violation : violations) {
    if (options.allow_overlaps.empty() || violation.find("overlap") == std::string::npos) ++unexplained;
  }
  const bool overlaps_explained = !options.allow_overlaps.empty();
  std::ostringstream row;
  row << "| " << options.backend << " | " << records.size() << " | " << (kinds.str().empty() ? "none" : kinds.str())
      << " | " << violations.size() << (overlaps_explained && !violations.empty() ? " (" + options.allow_overlaps + ")" : "")
      << " | " << stale << " of " << writes << " (" << rejected << " rejected)"
      << " | " << leaked << " | " << starved << " of " << timeouts << " | " << losses << " | "
      << (loss_latency_ms.empty() ? std::string("-") : std::to_string(percentile(loss_latency_ms, 0.5)) + " / " +
                                                            std::to_string(percentile(loss_latency_ms, 0.99)))
      << " | " << static_cast<int>(available_in_faults * 100 + 0.5) << "% / "
      << static_cast<int>(available_overall * 100 + 0.5) << "% |";
  std::cout << "| backend | holds | faults | overlaps | stale writes accepted | leaked entries | starved waiters "
               "| losses told | loss report ms p50 / p99 | availability in faults / overall |\n"
               "|---|---|---|---|---|---|---|---|---|---|\n"
            << row.str() << "\n";
  std::cout << "(" << (run_end_ns - run_start_ns) / 1000000000 << " s, " << errors << " client errors, " << crashed
            << " clients crashed, " << stuck << " did not stop in time)\n";
  for (std::size_t i = 0; i < violations.size() && i < 20; ++i) std::cout << "  " << violations[i] << "\n";
  if (!options.table_path.empty()) {
    std::ofstream(options.table_path, std::ios::app) << row.str() << "\n";
  }
  const bool failed = unexplained > 0 || stale > 0 || leaked > 0 || starved > 0 ||
                      crashed > 0 || stuck > 0 || records.empty();
  if (g_interrupted) {
    std::cerr << "faults: the run was interrupted: its figures cover only what ran\n";
    return 2;
  }
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace turnstile::faults

int main(int argc, char** argv) {
  using namespace turnstile::faults;
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) usage("no command");
  const std::string self = fs::canonical("/proc/self/exe").string();
  if (args[0] == "worker" || args[0] == "cli-worker") {
    if (args.size() != 12) usage("worker: wrong arguments");
    WorkerOptions options;
    options.url = args[1];
    options.ttl = std::chrono::milliseconds(std::stoll(args[2]));
    options.acquire_timeout = std::chrono::milliseconds(std::stoll(args[3]));
    options.prefix = args[4];
    options.names_per_kind = std::stoi(args[5]);
    options.out_dir = args[6];
    options.store_dir = args[7];
    options.id = std::stoi(args[8]);
    options.seed = std::stoull(args[9]);
    options.ignore_loss = args[11] == "ignore-loss";
    return args[0] == "worker" ? worker_main(options) : cli_worker_main(options, args[10], self);
  }
  if (args[0] == "cli-child") {
    if (args.size() != 5) usage("cli-child: wrong arguments");
    return cli_child_main(args[1], args[2], args[3], std::chrono::milliseconds(std::stoll(args[4])));
  }
  if (args[0] != "run") usage("unknown command '" + args[0] + "'");
  RunOptions options;
  for (std::size_t i = 1; i < args.size(); ++i) {
    const auto& flag = args[i];
    auto value = [&]() -> const std::string& {
      if (i + 1 >= args.size()) usage(flag + " needs a value");
      return args[++i];
    };
    if (flag == "--backend") options.backend = value();
    else if (flag == "--url") options.url = value();
    else if (flag == "--server") options.server_script = value();
    else if (flag == "--work") options.work_dir = value();
    else if (flag == "--seconds") options.seconds = std::chrono::seconds(std::stoll(value()));
    else if (flag == "--min-holds") options.min_holds = std::stoull(value());
    else if (flag == "--clients") options.clients = std::stoi(value());
    else if (flag == "--cli-clients") options.cli_clients = std::stoi(value());
    else if (flag == "--ttl-ms") options.ttl = std::chrono::milliseconds(std::stoll(value()));
    else if (flag == "--netns") options.netns_prefix = value();
    else if (flag == "--netns-script") options.netns_script = value();
    else if (flag == "--cli") options.cli_path = value();
    else if (flag == "--table") options.table_path = value();
    else if (flag == "--allow-overlaps") options.allow_overlaps = value();
    else if (flag == "--clients-ignore-loss") options.clients_ignore_loss = true;
    else if (flag == "--url-query") options.url_query = value();
    else if (flag == "--faults") {
      std::istringstream kinds(value());
      std::string kind;
      while (std::getline(kinds, kind, ',')) options.fault_kinds.push_back(kind);
    } else usage("unknown option " + flag);
  }
  for (const auto& kind : options.fault_kinds) {
    static const std::set<std::string> known{"server-kill", "server-pause", "client-pause", "client-kill", "partition",
                                             "client-partition"};
    if (!known.count(kind)) usage("unknown fault kind '" + kind + "'");
    if (kind.starts_with("server-") && options.server_script.empty()) usage(kind + " needs --server");
    if (kind.ends_with("partition") && options.netns_prefix.empty()) usage(kind + " needs --netns");
  }
  if (options.backend.empty() || options.work_dir.empty()) usage("--backend and --work are required");
  if (options.url.empty() == options.server_script.empty()) usage("give one of --url and --server");
  if (options.cli_clients > 0 && options.cli_path.empty()) usage("--cli PATH is needed for CLI clients");
  ::signal(SIGPIPE, SIG_IGN);
  catch_interrupts();
  try {
    return run(options, self);
  } catch (const std::exception& error) {
    std::cerr << "turnstile-faults: " << error.what() << "\n";
    return 2;
  }
}
