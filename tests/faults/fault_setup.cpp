// SPDX-License-Identifier: Apache-2.0
// The servers, network namespaces and client processes of a fault run (fault_setup.hpp).
#include "fault_setup.hpp"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "turnstile/turnstile.hpp"

namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace turnstile::faults {

std::string shell_quote(const std::string& text) {
  std::string out = "'";
  for (const char c : text) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

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

// ---- Servers ----------------------------------------------------------------------------------

Servers::~Servers() {
  for (const auto& id : std::set<std::string>(paused_)) resume(id);
  if (started_) run_command(shell_quote(script_) + " stop " + shell_quote(dir_));
}

std::string Servers::start() {
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

std::string Servers::pick(std::mt19937_64& random, bool leader) {
  if (!cluster()) return ids_.front();
  if (leader) {
    const auto [ok, output] = run_command(shell_quote(script_) + " leader " + shell_quote(dir_));
    std::istringstream fields(output);
    std::string id;
    if (ok && (fields >> id)) return id;
  }
  return ids_[random() % ids_.size()];
}

int Servers::namespace_of(const std::string& id) const {
  const auto it = std::find(ids_.begin(), ids_.end(), id);
  if (it == ids_.end()) throw std::runtime_error("no server node " + id);
  return static_cast<int>(it - ids_.begin()) + 1;
}

void Servers::kill(const std::string& id) {
  if (cluster()) {
    node_command("kill", id);
  } else {
    signal_pid(SIGKILL);
  }
}

void Servers::restart(const std::string& id, bool wipe) {
  if (cluster()) {
    node_command("start-node", id, wipe ? " wipe" : "");
  } else {
    run_command(shell_quote(script_) + " restart " + shell_quote(dir_) + " >&2");
  }
}

void Servers::pause(const std::string& id) {
  paused_.insert(id);
  if (cluster()) {
    node_command("pause", id);
  } else {
    signal_pid(SIGSTOP);
  }
}

void Servers::resume(const std::string& id) {
  paused_.erase(id);
  if (cluster()) {
    node_command("resume", id);
  } else {
    signal_pid(SIGCONT);
  }
}

void Servers::node_command(const std::string& verb, const std::string& id, const std::string& extra) {
  run_command(shell_quote(script_) + " " + verb + " " + shell_quote(dir_) + " " + shell_quote(id) + extra + " >&2");
}

void Servers::signal_pid(int signal) {
  const auto pid = read_file(pid_file_);
  if (!pid.empty()) ::kill(std::stoi(pid), signal);
}

// ---- NetworkNamespaces ------------------------------------------------------------------------

namespace {
std::string address(int index) { return "10.213.0." + std::to_string(10 + index); }
}  // namespace

NetworkNamespaces::NetworkNamespaces(std::string script, const std::string& prefix, int servers, int clients)
    : script_(std::move(script)), prefix_(prefix + "-" + std::to_string(::getpid())), servers_(servers) {
  const int total = servers + clients + 1;
  if (!run_command(shell_quote(script_) + " up " + shell_quote(prefix_) + " " + std::to_string(total) + " >&2").first) {
    run_command(shell_quote(script_) + " down " + shell_quote(prefix_));  // what a failed `up` made
    throw std::runtime_error("could not make the network namespaces (root and `ip netns` are needed)");
  }
  // The server scripts start node i in the i-th namespace, listening on the i-th address.
  std::string names, hosts;
  for (int i = 1; i <= servers; ++i) {
    names += (i > 1 ? " " : "") + prefix_ + "-" + std::to_string(i);
    hosts += (i > 1 ? " " : "") + address(i);
  }
  ::setenv("TURNSTILE_CLUSTER_NETNS", names.c_str(), 1);
  ::setenv("TURNSTILE_CLUSTER_HOSTS", hosts.c_str(), 1);
  const auto own = path(total);
  const int fd = ::open(own.c_str(), O_RDONLY | O_CLOEXEC);
  const bool entered = fd >= 0 && ::setns(fd, CLONE_NEWNET) == 0;
  if (fd >= 0) ::close(fd);
  if (!entered) {
    run_command(shell_quote(script_) + " down " + shell_quote(prefix_));
    throw std::runtime_error("cannot enter " + own);
  }
}

NetworkNamespaces::~NetworkNamespaces() { run_command(shell_quote(script_) + " down " + shell_quote(prefix_)); }

void NetworkNamespaces::cut(int index) {
  run_command(shell_quote(script_) + " cut " + shell_quote(prefix_) + " " + std::to_string(index));
}

void NetworkNamespaces::heal(int index) {
  run_command(shell_quote(script_) + " heal " + shell_quote(prefix_) + " " + std::to_string(index));
}

// ---- Clients ----------------------------------------------------------------------------------

Clients::~Clients() {
  for (auto& [pid, info] : live_) {
    ::kill(pid, SIGCONT);
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
}

void Clients::start_all() {
  for (int i = 0; i < run_.clients; ++i) spawn(i, false);
  for (int i = 0; i < run_.cli_clients; ++i) spawn(run_.clients + i, true);
}

std::optional<pid_t> Clients::pick_library_client(std::mt19937_64& random) {
  std::vector<pid_t> candidates;
  for (const auto& [pid, info] : live_) {
    if (!info.cli) candidates.push_back(pid);
  }
  if (candidates.empty()) return std::nullopt;
  return candidates[random() % candidates.size()];
}

std::optional<pid_t> Clients::pick_holder(const std::string& url, std::vector<std::string> names,
                                          std::mt19937_64& random) {
  std::shuffle(names.begin(), names.end(), random);
  // Mutexes first: a paused exclusive holder is the case fencing exists for.
  std::stable_partition(names.begin(), names.end(),
                        [](const std::string& name) { return name.find("/mutex") != std::string::npos; });
  try {
    ClientOptions options;
    options.connect_timeout = 2s;
    auto client = Client::connect(url, options);
    for (const auto& name : names) {
      for (const auto& holder : client.inspect(name, SteadyClock::now() + 1s).holders) {
        const auto it = live_.find(static_cast<pid_t>(holder.pid));
        if (it != live_.end() && !it->second.cli) return it->first;
      }
    }
  } catch (const Error&) {
    // The server may be down: any client will do.
  }
  return pick_library_client(random);
}

void Clients::kill_and_replace(pid_t pid) {
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  const auto info = live_.at(pid);
  live_.erase(pid);
  spawn(info.slot, info.cli);
}

int Clients::stop_all(std::chrono::milliseconds grace) {
  for (const auto& [pid, info] : live_) ::kill(pid, SIGTERM);
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
      for (const auto& [left, info] : live_) {
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

int Clients::reap_and_restart() {
  int crashed = 0;
  for (;;) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) break;
    const auto it = live_.find(pid);
    if (it == live_.end()) continue;
    const auto info = it->second;
    live_.erase(it);
    std::cerr << "client " << pid << " exited by itself (status " << status << "); starting another\n";
    ++crashed;
    spawn(info.slot, info.cli);
  }
  return crashed;
}

void Clients::spawn(int slot, bool cli) {
  auto options = base_;
  options.id = next_id_++;
  options.seed = base_.seed * 1000003 + static_cast<std::uint64_t>(options.id);
  std::vector<std::string> args;
  args.insert(args.end(),
              {self_, cli ? "cli-worker" : "worker", options.url, std::to_string(options.ttl.count()),
               std::to_string(options.acquire_timeout.count()), options.prefix, std::to_string(options.names_per_kind),
               options.out_dir, options.store_dir, std::to_string(options.id), std::to_string(options.seed),
               run_.cli_path, options.ignore_loss ? "ignore-loss" : "check-loss"});
  std::vector<char*> argv;
  for (auto& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  // Opened before the fork: the child only switches to it (a client cut off alone must run in
  // a namespace of its own, not in this process's).
  const int netns = namespaces_ ? ::open(namespaces_->client_namespace(slot).c_str(), O_RDONLY | O_CLOEXEC) : -1;
  if (namespaces_ && netns < 0) throw std::runtime_error("cannot open " + namespaces_->client_namespace(slot));
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (netns >= 0 && ::setns(netns, CLONE_NEWNET) != 0) ::_exit(126);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  if (netns >= 0) ::close(netns);
  if (pid < 0) throw std::runtime_error("fork failed");
  live_[pid] = Live{cli, slot};
}

}  // namespace turnstile::faults
