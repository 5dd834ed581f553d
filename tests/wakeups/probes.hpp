// SPDX-License-Identifier: Apache-2.0
// What the wake-up and async-waiter tests count: the servers' own counters of the waiters they
// woke and the requests they got (each read over a plain loopback socket, no client library),
// and this process's threads and memory (/proc/self).
#pragma once

#include <sys/types.h>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <turnstile/client.hpp>

namespace wakeups {

// ---- talking to the servers (loopback, plain sockets) -------------------------------------

struct HostPort {
  std::string host;
  std::string port;
};

// The first host:port of a test server's URL (scheme://[user@]host:port[,...][/...][?...]).
HostPort host_port(const std::string& url);
// Sends `request` and reads until the server closes (HTTP/1.0, ZooKeeper's four-letter words).
std::string ask(const HostPort& where, const std::string& request);
// The number after `key` (and the separator that follows it) in `text`, 0 when absent.
double number_after(const std::string& text, const std::string& key);

// ---- what a release did, as one backend can count it ---------------------------------------

struct Counts {
  double woken = 0;     // waiters the server (or kernel) woke
  double requests = 0;  // requests the server got (what a woken waiter sends to look again)
};

// Counts server-side events between two snapshots: snapshot() returns the counters now;
// since() what happened since a snapshot.
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
  // False when the counter could not reach what it reads (Redis: no MONITOR connection).
  virtual bool ok() const { return true; }
};

// The counter for the server behind `url` (consul, etcd, zk, redis; `name`: the name whose
// wake-ups count), nullptr for file:// (no server: the tests count threads instead).
std::unique_ptr<ServerCounter> server_counter(const std::string& url, const std::string& name);

// ---- one backend's plan for 1000 waiters -------------------------------------------------

struct HerdPlan {
  std::string scheme;                     // "file", "redis", "zk", "etcd", "consul"
  std::unique_ptr<ServerCounter> server;  // none on file://
  bool client_per_waiter = false;         // etcd: each waiter (and the holder) has a client of its own
  std::size_t waiters = 1000;
  turnstile::ClientOptions options;  // for the clients made per waiter
  // Why the count cannot be taken ("" when it can).
  std::string problem(const std::string& url) const;
};
HerdPlan herd_plan(const std::string& url, const std::string& name);

// ---- this process ------------------------------------------------------------------------

pid_t this_thread_id();
// A thread's voluntary context switches: one more each time it blocks (after running again).
long voluntary_switches(pid_t tid);
long rss_kib();
// This process's threads (/proc/self/task), and their names (comm) with how many share each.
std::vector<pid_t> thread_ids();
std::string thread_names();

// The voluntary switches of each of `tids` (-1 for a thread gone).
std::vector<long> switches_of(const std::vector<pid_t>& tids);
// How many places differ between two lists of switch counts of the same threads.
std::size_t changed_count(const std::vector<long>& before, const std::vector<long>& after);

// ---- the measurement around one release ---------------------------------------------------

// Until every waiter sleeps: neither `switches()` (the counts of the threads that matter) nor
// the server's woken count change for half a second (at most 10 s). `last` receives the last
// switch counts; returns the server's last snapshot (zero without a server).
Counts wait_until_quiet(const std::function<std::vector<long>()>& switches, ServerCounter* server,
                        std::vector<long>& last);
// Empty when `after` (inspected after one admission) shows `queued`'s waiters but the first,
// in the same order; else which one moved.
std::string order_change(const turnstile::Inspection& queued, const turnstile::Inspection& after);

// The lines joined with "; " (for a failure message), "none" when there are none.
std::string joined(const std::vector<std::string>& lines);

}  // namespace wakeups
