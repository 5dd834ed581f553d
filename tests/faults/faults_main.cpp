// SPDX-License-Identifier: Apache-2.0
// turnstile-faults: a Jepsen-style run of turnstile under injected faults (issue 14).
//
//   turnstile-faults run --backend LABEL --url URL | --server SCRIPT  --work DIR
//        [--seconds S] [--min-holds N] [--clients N] [--cli-clients N] [--ttl-ms MS]
//        [--faults server-kill,server-pause,client-pause,client-kill,partition,client-partition]
//        [--netns PREFIX --netns-script tests/servers/netns.sh [--netns-servers N]]
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
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
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
#include "fault_setup.hpp"
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

struct FaultWindow {
  std::string kind;
  std::int64_t start_ns = 0;
  std::int64_t end_ns = 0;
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
    if (left == 0 || std::chrono::steady_clock::now() > until)
      return left == static_cast<std::size_t>(-1) ? names.size() : left;
    std::this_thread::sleep_for(500ms);
  }
}

// The election row (issue 27): leaderships are recorded as exclusive holds of the names with
// "/elect" (fault_worker.cpp), so "no two leaders at once" is the exclusive no-overlap check on
// those names; the row counts them apart from the run's other names.
struct ElectionTally {
  bool offered = false;  // the backend has an election layout (else its names were passed over)
  std::size_t leaderships = 0, overlaps = 0, stale = 0, starved = 0, timeouts = 0, losses = 0;

  std::string row(const std::string& backend, const std::string& kinds) const {
    std::ostringstream out;
    out << "| " << backend << ": elections | ";
    if (!offered) {
      out << "passed over (no election layout) | | | | | | | | |";
      return out.str();
    }
    out << leaderships << " leaderships | " << kinds << " | " << overlaps << " (no two leaders at once) | " << stale
        << " | - | " << starved << " of " << timeouts << " | " << losses << " | - | - |";
    return out.str();
  }
};

bool has_elections(const std::string& url, const std::string& prefix) {
  try {
    static_cast<void>(Client::connect(url).election(prefix + "/elect0"));
    return true;
  } catch (const InvalidArgument&) {
    return false;
  } catch (const Error& error) {
    std::cerr << "elections: " << error.what() << "\n";
    return true;  // counted as offered: a row with no leaderships fails the run
  }
}

// After a fault, the time the engines need to recover (a dead lease runs out, a new leader is
// elected): waits and gaps inside it are not starvation.
// A Sentinel fail-over beside a sanitizer build once took 128 ms more than 2 x TTL + 3 s to name
// the new primary: 5 s are allowed besides the TTLs.
std::int64_t recovery_ns_for(std::chrono::milliseconds ttl) { return std::chrono::nanoseconds(2 * ttl + 5s).count(); }

int run(const RunOptions& options, const std::string& self) {
  // The work directory is this tool's: an earlier run's (its marker) or a new one. An earlier
  // run's servers, left by a crash, are stopped before their pid files go.
  const auto marker = fs::path(options.work_dir) / ".turnstile-faults";
  const bool earlier_run = fs::exists(marker) || fs::exists(fs::path(options.work_dir) / "faults.log");
  if (fs::exists(options.work_dir) && !fs::is_empty(options.work_dir) && !earlier_run) {
    throw std::runtime_error(options.work_dir + " is not empty and not a fault run's work directory: not removing it");
  }
  if (!options.server_script.empty() && fs::exists(fs::path(options.work_dir) / "servers")) {
    run_command(shell_quote(options.server_script) + " stop " +
                shell_quote((fs::path(options.work_dir) / "servers").string()));
  }
  fs::remove_all(options.work_dir);
  fs::create_directories(options.work_dir);
  std::ofstream(marker) << "a turnstile-faults work directory\n";
  fs::create_directories(fs::path(options.work_dir) / "clients");
  const auto clients_dir = (fs::path(options.work_dir) / "clients").string();
  // Partitions: each server node and each client in a network namespace of its own, this
  // process in one more, all joined by a bridge that netns.sh cuts one link of.
  std::optional<NetworkNamespaces> namespaces;
  if (!options.netns_prefix.empty()) {
    if (::geteuid() == 0) {
      namespaces.emplace(options.netns_script, options.netns_prefix, options.netns_servers,
                         options.clients + options.cli_clients);
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

  EventLog fault_log((fs::path(options.work_dir) / "faults.log").string());  // kind start_ns end_ns target
  Clients clients(options, base, self, namespaces ? &*namespaces : nullptr);
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
    std::string target;  // what it hit, for the fault log: "node ID" or "client PID"
    if (kind == "server-kill" && servers) {
      const auto id = servers->pick(random, hit_leader);
      hit_leader = !hit_leader;
      target = "node " + id;
      servers->kill(id);
      calm(std::chrono::milliseconds(500 + random() % 1500));
      servers->restart(id, servers->cluster() && (wipe = !wipe));
    } else if (kind == "server-pause" && servers) {
      const auto id = servers->pick(random, hit_leader);
      hit_leader = !hit_leader;
      target = "node " + id;
      servers->pause(id);
      calm(options.ttl + 1s);
      servers->resume(id);
    } else if (kind == "client-pause") {
      if (const auto pid = clients.pick_holder(url, run_names(base.prefix, base.names_per_kind), random)) {
        target = "client " + std::to_string(*pid);
        ::kill(*pid, SIGSTOP);
        calm(2 * options.ttl + 500ms);  // past its TTL: others are admitted meanwhile
        ::kill(*pid, SIGCONT);
      }
    } else if (kind == "client-kill") {
      if (const auto pid = clients.pick_library_client(random)) {
        target = "client " + std::to_string(*pid);
        clients.kill_and_replace(*pid);
      }
    } else if (kind == "partition" && servers && servers->cluster() && namespaces) {
      // One server node (the leader or primary every other time) cut off from the other nodes
      // and from every client, past the TTL.
      const auto id = servers->pick(random, hit_leader);
      const int node = servers->namespace_of(id);
      hit_leader = !hit_leader;
      target = "node " + id;
      namespaces->cut_server(node);
      calm(options.ttl + 1s);
      namespaces->heal_server(node);
    } else if (kind == "client-partition" && namespaces) {
      // One client (one that holds, if any does) cut off from every server and every other
      // client past its TTL, while the others go on: they take its names once its entries run
      // out, so it must have been told of its losses before that, and must find its way back.
      if (const auto pid = clients.pick_holder(url, run_names(base.prefix, base.names_per_kind), random)) {
        const int slot = clients.slot_of(*pid);
        target = "client " + std::to_string(*pid);
        namespaces->cut_client(slot);
        calm(options.ttl + 1s);
        namespaces->heal_client(slot);
      }
    } else {
      continue;  // a kind this run cannot inject
    }
    window.end_ns = monotonic_ns();
    fault_log.line(kind + " " + std::to_string(window.start_ns) + " " + std::to_string(window.end_ns) + " " + target);
    faults.push_back(window);
    ++fault_counts[kind];
  }
  // A calm tail longer than an acquire's bound: a waiter left stuck by a fault (a lost wake-up)
  // times out in it, with the name free and no fault near, and is reported starved.
  if (!g_interrupted) {
    calm(base.acquire_timeout +
         std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::nanoseconds(recovery_ns_for(options.ttl))) +
         1s);
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
  const auto violations = testing::check(
      records, [](const std::string& name) -> std::int64_t { return is_semaphore_name(name) ? kSemaphoreLimit : 0; });
  const auto events = load_events(clients_dir);
  ElectionTally elections;
  elections.offered = has_elections(url, base.prefix);
  for (const auto& record : records) elections.leaderships += is_election_name(record.name);
  for (const auto& violation : violations) elections.overlaps += is_election_name(violation);

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
        elections.stale += is_election_name(event.name);
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
    elections.timeouts += is_election_name(event.name);
    auto busy = held[event.name];
    busy.insert(busy.end(), recovering.begin(), recovering.end());
    busy = merge(busy);
    if (longest_gap(busy, event.a_ns, event.b_ns) > free_bound_ns) {
      ++starved;
      elections.starved += is_election_name(event.name);
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
    elections.losses += is_election_name(event.name);
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
      << " | " << violations.size()
      << (overlaps_explained && !violations.empty() ? " (" + options.allow_overlaps + ")" : "") << " | " << stale
      << " of " << writes << " (" << rejected << " rejected)"
      << " | " << leaked << " | " << starved << " of " << timeouts << " | " << losses << " | "
      << (loss_latency_ms.empty() ? std::string("-")
                                  : std::to_string(percentile(loss_latency_ms, 0.5)) + " / " +
                                        std::to_string(percentile(loss_latency_ms, 0.99)))
      << " | " << static_cast<int>(available_in_faults * 100 + 0.5) << "% / "
      << static_cast<int>(available_overall * 100 + 0.5) << "% |";
  std::cout << "| backend | holds | faults | overlaps | stale writes accepted | leaked entries | starved waiters "
               "| losses told | loss report ms p50 / p99 | availability in faults / overall |\n"
               "|---|---|---|---|---|---|---|---|---|---|\n"
            << row.str() << "\n"
            << elections.row(options.backend, kinds.str().empty() ? "none" : kinds.str()) << "\n";
  std::cout << "(" << (run_end_ns - run_start_ns) / 1000000000 << " s, " << errors << " client errors, " << crashed
            << " clients crashed, " << stuck << " did not stop in time)\n";
  for (std::size_t i = 0; i < violations.size() && i < 20; ++i) std::cout << "  " << violations[i] << "\n";
  if (!options.table_path.empty()) {
    std::ofstream(options.table_path, std::ios::app)
        << row.str() << "\n"
        << elections.row(options.backend, kinds.str().empty() ? "none" : kinds.str()) << "\n";
  }
  // A backend with elections must have elected someone: the election row really ran.
  const bool failed = unexplained > 0 || stale > 0 || leaked > 0 || starved > 0 || crashed > 0 || stuck > 0 ||
                      records.empty() || (elections.offered && elections.leaderships == 0);
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
    else if (flag == "--netns-servers") options.netns_servers = std::stoi(value());
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
    static const std::set<std::string> known{"server-kill", "server-pause", "client-pause",
                                             "client-kill", "partition",    "client-partition"};
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
