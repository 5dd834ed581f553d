// SPDX-License-Identifier: Apache-2.0
// What a fault run sets up and drives (faults_main.cpp runs it): the servers through their test
// scripts, the network namespaces partitions need, and the client processes.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "fault_worker.hpp"

namespace turnstile::faults {

std::string shell_quote(const std::string& text);
// Runs a shell command; whether it exited 0, and its standard output.
std::pair<bool, std::string> run_command(const std::string& command);
// A file's text without its trailing newlines and spaces.
std::string read_file(const std::filesystem::path& path);

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
  int netns_servers = 3;  // how many namespaces the server script's nodes take, one each
  std::string cli_path;
  std::string table_path;
  std::string allow_overlaps;  // why overlaps are the engine's documented behaviour, or empty
  bool clients_ignore_loss = false;
  std::string url_query;  // appended to the servers' URL, e.g. min_replicas=1
};

// The servers of a run, driven through their test script: one node (SCRIPT restart DIR, the
// pid file) or a cluster (SCRIPT kill/start-node/pause/resume/leader DIR ID, DIR/nodes).
class Servers {
 public:
  Servers(std::string script, std::string dir) : script_(std::move(script)), dir_(std::move(dir)) {}
  ~Servers();
  Servers(const Servers&) = delete;
  Servers& operator=(const Servers&) = delete;

  // Starts them; the URL clients use.
  std::string start();
  bool cluster() const { return pid_file_.empty(); }
  // The node a fault should hit: the leader every other time, a node at random otherwise.
  std::string pick(std::mt19937_64& random, bool leader);
  // Which of the servers' network namespaces node `id` runs in (1 for the first node of
  // DIR/nodes: the scripts give namespaces in that order).
  int namespace_of(const std::string& id) const;

  void kill(const std::string& id);
  void restart(const std::string& id, bool wipe);
  void pause(const std::string& id);
  void resume(const std::string& id);

 private:
  void node_command(const std::string& verb, const std::string& id, const std::string& extra = "");
  void signal_pid(int signal);

  std::string script_;
  std::string dir_;
  bool started_ = false;
  std::vector<std::string> ids_;
  std::filesystem::path pid_file_;
  std::set<std::string> paused_;
};

// Network namespaces for partitions (tests/servers/netns.sh), made for the run and deleted
// after it: PREFIX-1..S for the server nodes (one each), then one per client process, then one
// for this process (it starts, watches and checks, and is never cut off). The prefix gets this
// process's id, so that no other run's namespaces are touched. Enters its own namespace: make
// it before any thread starts.
class NetworkNamespaces {
 public:
  NetworkNamespaces(std::string script, const std::string& prefix, int servers, int clients);
  ~NetworkNamespaces();
  NetworkNamespaces(const NetworkNamespaces&) = delete;
  NetworkNamespaces& operator=(const NetworkNamespaces&) = delete;

  void cut_server(int node) { cut(node); }
  void heal_server(int node) { heal(node); }
  void cut_client(int slot) { cut(servers_ + 1 + slot); }
  void heal_client(int slot) { heal(servers_ + 1 + slot); }
  // The namespace file client `slot` (0-based) runs in.
  std::string client_namespace(int slot) const { return path(servers_ + 1 + slot); }

 private:
  void cut(int index);
  void heal(int index);
  std::string path(int index) const { return "/run/netns/" + prefix_ + "-" + std::to_string(index); }

  std::string script_;
  std::string prefix_;
  int servers_;
};

// The client processes, started again when a fault kills one. Each has a slot (0-based: the
// library clients first, then the CLI clients) that a replacement takes over, with the slot's
// network namespace when there are namespaces.
class Clients {
 public:
  Clients(const RunOptions& run, WorkerOptions base, std::string self, const NetworkNamespaces* namespaces)
      : run_(run), base_(std::move(base)), self_(std::move(self)), namespaces_(namespaces) {}
  ~Clients();
  Clients(const Clients&) = delete;
  Clients& operator=(const Clients&) = delete;

  void start_all();
  // A library client at random (the ones that hold through the library, for pauses and kills).
  std::optional<pid_t> pick_library_client(std::mt19937_64& random);
  // A library client that holds one of `names` now (the Kleppmann pause hits a holder), else
  // any library client.
  std::optional<pid_t> pick_holder(const std::string& url, std::vector<std::string> names, std::mt19937_64& random);
  int slot_of(pid_t pid) const { return live_.at(pid).slot; }
  void kill_and_replace(pid_t pid);
  // SIGTERM to all; each leaves its queue and exits within its acquire bound. Returns how many
  // had to be killed.
  int stop_all(std::chrono::milliseconds grace);
  // Clients that exited on their own (a crash), reaped and started again.
  int reap_and_restart();

 private:
  struct Live {
    bool cli = false;
    int slot = 0;
  };
  void spawn(int slot, bool cli);

  const RunOptions& run_;
  WorkerOptions base_;
  std::string self_;
  const NetworkNamespaces* namespaces_;
  int next_id_ = 1;
  std::map<pid_t, Live> live_;
};

}  // namespace turnstile::faults
