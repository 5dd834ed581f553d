// SPDX-License-Identifier: Apache-2.0
// Helpers shared by the tests of the network backends (tests/redis, tests/zookeeper,
// tests/etcd): the server's URL from its fixture's file, shell commands for the peers' own
// tools (redis-cli, etcdctl, a Curator JVM), bounded waits, and unique names.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <unistd.h>

#include <turnstile/turnstile.hpp>

#include "conformance/support.hpp"

namespace server_tests {

using namespace std::chrono_literals;

// The first line of a file ("" when missing): where a CTest fixture leaves its server's URL.
inline std::string read_first_line(const std::string& path) {
  std::ifstream file(path);
  std::string line;
  std::getline(file, line);
  return line;
}

// Runs a shell command; returns its output (stderr included) without the trailing newline.
inline std::string shell(const std::string& command) {
  std::string output;
  if (FILE* pipe = popen((command + " 2>&1").c_str(), "r")) {
    std::array<char, 4096> buffer;
    while (std::fgets(buffer.data(), buffer.size(), pipe)) output += buffer.data();
    pclose(pipe);
  }
  while (!output.empty() && (output.back() == '\n' || output.back() == '\r')) output.pop_back();
  return output;
}

// Single-quotes a string for the shell.
inline std::string quoted(const std::string& text) {
  std::string out = "'";
  for (char c : text) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// redis-cli against the server of a redis:// URL (the redis tests' peer for raw commands).
inline std::string redis_cli(const std::string& url, const std::string& arguments) {
  return shell("redis-cli -u " + quoted(url) + " " + arguments);
}

// Polls until `predicate` holds or `timeout` passes; returns its last value.
inline bool eventually(const std::function<bool()>& predicate, std::chrono::milliseconds timeout = 10s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (predicate()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return predicate();
}

// A name unique to this test run: tests sharing a fixture server never see each other's state.
// Waits up to `bound` for `mutex` on another thread: true when it got it (released at once).
inline std::future<bool> lock_in_background(turnstile::Mutex& mutex, std::chrono::milliseconds bound) {
  return std::async(std::launch::async, [&mutex, bound] {
    const bool got = mutex.try_lock_for(bound);
    if (got) mutex.unlock();
    return got;
  });
}

inline std::string unique_name(const std::string& leaf) {
  return "test/" + std::to_string(getpid()) + "-" + std::to_string(std::random_device{}()) + "/" + leaf;
}

inline turnstile::ClientOptions with_ttl(std::chrono::milliseconds ttl) {
  turnstile::ClientOptions options;
  options.ttl = ttl;
  return options;
}

// Every change of hold state a client reports (ClientOptions::on_hold_state), for tests of
// suspension and loss. Must outlive the clients made with its options().
class HoldStateLog {
 public:
  turnstile::ClientOptions options(std::chrono::milliseconds ttl) {
    auto result = with_ttl(ttl);
    result.on_hold_state = [this](const turnstile::HoldStateChange& change) {
      std::lock_guard lock(mutex_);
      changes_.push_back(change);
    };
    return result;
  }
  // The states one hold went through, in order.
  std::vector<turnstile::HoldState> states_of(const std::string& name) const {
    std::lock_guard lock(mutex_);
    std::vector<turnstile::HoldState> states;
    for (const auto& change : changes_) {
      if (change.name == name) states.push_back(change.state);
    }
    return states;
  }
  bool reached(const std::string& name, turnstile::HoldState state) const {
    const auto states = states_of(name);
    return !states.empty() && states.back() == state;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<turnstile::HoldStateChange> changes_;
};

// What a client told its error handler and its hold-loss handler (ClientOptions), for tests
// that must fail on a report they did not expect (a release that found its entry gone is only
// reported there). Must outlive the clients made with its options().
class ErrorReports {
 public:
  turnstile::ClientOptions options(std::chrono::milliseconds ttl) {
    auto result = with_ttl(ttl);
    result.error_handler = [this](const turnstile::Error& error) {
      std::lock_guard lock(mutex_);
      seen_.push_back(error.what());
    };
    result.on_hold_lost = result.error_handler;
    return result;
  }
  // Every report, one a line ("" when none).
  std::string all() const {
    std::lock_guard lock(mutex_);
    std::string text;
    for (const auto& report : seen_) text += report + "\n";
    return text;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::string> seen_;
};

// Even-numbered names are Mutexes, odd ones Semaphores (2 permits of 2): each is acquired, in
// a thread of its own (all joins at once) within `within`, and released. Returns how many
// were held. For tests of joins held up on the way (they must not come back later).
inline std::size_t hold_and_release_each(turnstile::Client& client, const std::vector<std::string>& names,
                                         std::chrono::milliseconds within) {
  std::atomic<std::size_t> held{0};
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < names.size(); ++i) {
    threads.emplace_back([&, i] {
      if (i % 2 == 0) {
        auto mutex = client.mutex(names[i]);
        if (!mutex.try_lock_for(within)) return;
        mutex.unlock();
      } else {
        auto lease = client.semaphore(names[i], 2).try_acquire_for(within, 2);
        if (!lease) return;
        lease->release();
      }
      ++held;
    });
  }
  for (auto& thread : threads) thread.join();
  return held.load();
}

// The names that have an entry (held or waiting), one a line.
inline std::string names_with_entries(turnstile::Client& observer, const std::vector<std::string>& names) {
  std::string found;
  for (const auto& name : names) {
    const auto state = observer.inspect(name);
    if (!state.holders.empty() || !state.waiters.empty()) found += name + "\n";
  }
  return found;
}

// Two clients of one server: a Mutex `name` held by `client` keeps out a waiter of `other` (it
// was still waiting 300 ms on), whom the release admits with a larger token; a Semaphore of 2
// admits two and no third.
inline void expect_handover(turnstile::Client& client, turnstile::Client& other, const std::string& name) {
  auto mutex = client.mutex(name);
  auto theirs = other.mutex(name);
  mutex.lock();
  const auto first_token = mutex.fencing_token();
  EXPECT_FALSE(theirs.try_lock());
  // Holds belong to threads: the waiter takes, reads its token and unlocks in its own.
  auto waiter = std::async(std::launch::async, [&]() -> std::uint64_t {
    if (!theirs.try_lock_for(20s)) return 0;
    const auto their_token = theirs.fencing_token();
    theirs.unlock();
    return their_token;
  });
  EXPECT_EQ(waiter.wait_for(300ms), std::future_status::timeout) << "a waiter got in while the lock was held";
  mutex.unlock();
  EXPECT_GT(waiter.get(), first_token)
      << "the waiter was not admitted after the release (token 0), or its token did not grow";
  auto pool = client.semaphore(unique_name("pool"), 2);
  auto a = pool.acquire();
  auto b = pool.acquire();
  EXPECT_FALSE(pool.try_acquire_for(100ms));
}

// The primary serving a held name changes by `fault(primary)` (`primary()` names it, before and
// after): the holder is told it lost the hold within `loss_bound` (long before its TTL) and before
// a waiter queued on the old primary is admitted on the new one; the lost holder's release lets
// the waiter in, with a larger token; a new client finds the new primary at once. Clients of
// `url` with TTL 15 s: renewed every 5 s, and each renewal round asks who the primary is.
inline void expect_failover_reported(const std::string& url, const std::string& name,
                                     const std::function<std::string()>& primary,
                                     const std::function<void(const std::string&)>& fault,
                                     std::chrono::milliseconds loss_bound) {
  auto client = turnstile::Client::connect(url, with_ttl(15s));
  auto mutex = client.mutex(name);
  mutex.lock();
  const auto token = mutex.fencing_token();
  const auto lost = mutex.lost_token();
  auto waiting = turnstile::Client::connect(url, with_ttl(15s));
  auto theirs = waiting.mutex(name);
  std::atomic<bool> lost_at_admission{false};
  auto waiter = std::async(std::launch::async, [&]() -> std::uint64_t {
    if (!theirs.try_lock_for(60s)) return 0;
    lost_at_admission = lost.stop_requested();
    const auto their_token = theirs.fencing_token();
    theirs.unlock();
    return their_token;
  });
  ASSERT_EQ(waiter.wait_for(500ms), std::future_status::timeout) << "a waiter got in while the lock was held";
  const auto before = primary();
  const auto started = std::chrono::steady_clock::now();
  fault(before);
  EXPECT_TRUE(eventually([&] { return lost.stop_requested(); }, loss_bound))
      << "the hold survived a change of primary (from " << before << ")";
  const auto noticed = std::chrono::steady_clock::now() - started;
  std::printf("hold reported lost %lld ms after the fault\n",
              static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(noticed).count()));
  EXPECT_TRUE(eventually(
      [&] {
        const auto now = primary();
        return !now.empty() && now != before;
      },
      10s));
  // The waiter was still waiting when the loss was reported (its entry reached the replica).
  EXPECT_EQ(waiter.wait_for(0s), std::future_status::timeout) << "the waiter was admitted before the holder was told";
  // The lost holder's release goes to the new primary (its replicated entry leaves).
  try {
    mutex.unlock();
  } catch (const turnstile::HoldLost&) {
  }
  ASSERT_EQ(waiter.wait_for(30s), std::future_status::ready) << "the waiter was not served by the new primary";
  EXPECT_GT(waiter.get(), token)
      << "the waiter was not served (0), or fencing tokens went backwards across the failover";
  EXPECT_TRUE(lost_at_admission) << "the waiter was admitted before the holder was told";
  auto fresh = turnstile::Client::connect(url);
  EXPECT_TRUE(fresh.mutex(name).try_lock_for(5s));
}

// A holder whose client has TTL `ttl`, killed with SIGKILL: another client gets its Mutex
// within `bound` of the kill (what the backend's session or lease expiry promises).
inline void expect_killed_holder_freed_within(const std::string& url, std::chrono::milliseconds ttl,
                                              std::chrono::milliseconds bound) {
  const auto name = unique_name("killed");
  conformance::Pipe ready;
  auto child = conformance::Child::spawn([&]() -> int {
    auto own = turnstile::Client::connect(url, with_ttl(ttl));
    auto mutex = own.mutex(name);
    mutex.lock();
    ready.send();
    conformance::linger_in_child();
  });
  ASSERT_TRUE(ready.receive());
  auto client = turnstile::Client::connect(url);
  auto mutex = client.mutex(name);
  EXPECT_FALSE(mutex.try_lock());
  child.kill(SIGKILL);
  EXPECT_EQ(child.wait(), 128 + SIGKILL);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(mutex.try_lock_for(10s));
  EXPECT_LT(std::chrono::steady_clock::now() - start, bound);
  mutex.unlock();
}

// Holds a Mutex and a Semaphore lease of a client with TTL `ttl` through an outage that
// `begin` starts and `end` ends (the client's session or lease must outlive it), and checks
// what the holder is told: suspended during it, held again after it, never lost; and that the
// holds still exclude others, and release normally, afterwards.
inline void expect_outage_suspends_then_resumes(const std::string& url, std::chrono::milliseconds ttl,
                                                const std::function<void()>& begin, const std::function<void()>& end) {
  using turnstile::HoldState;
  HoldStateLog log;
  auto client = turnstile::Client::connect(url, log.options(ttl));
  const auto lock_name = unique_name("outage-lock");
  const auto semaphore_name = unique_name("outage-semaphore");
  auto mutex = client.mutex(lock_name);
  mutex.lock();
  auto lease = client.semaphore(semaphore_name, 1).acquire();
  const auto token = mutex.fencing_token();
  EXPECT_EQ(mutex.hold_state(), HoldState::held);

  begin();
  EXPECT_TRUE(eventually([&] { return mutex.hold_state() == HoldState::suspended; }, 20s));
  EXPECT_TRUE(eventually([&] { return lease.hold_state() == HoldState::suspended; }, 5s));
  EXPECT_TRUE(mutex.owns_lock()) << "a suspended hold is still this thread's to release";
  end();
  EXPECT_TRUE(eventually([&] { return mutex.hold_state() == HoldState::held; }, 30s));
  EXPECT_TRUE(eventually([&] { return lease.hold_state() == HoldState::held; }, 5s));
  const std::vector<HoldState> told{HoldState::suspended, HoldState::held};
  EXPECT_EQ(log.states_of(lock_name), told);
  EXPECT_EQ(log.states_of(semaphore_name), told);
  EXPECT_FALSE(mutex.lost_token().stop_requested());
  EXPECT_FALSE(lease.lost_token().stop_requested());
  EXPECT_EQ(mutex.fencing_token(), token);

  auto other = turnstile::Client::connect(url);
  auto other_mutex = other.mutex(lock_name);
  EXPECT_FALSE(other_mutex.try_lock()) << "the resumed hold must still exclude";
  EXPECT_FALSE(other.semaphore(semaphore_name, 1).try_acquire().has_value());
  EXPECT_NO_THROW(mutex.release());
  EXPECT_NO_THROW(lease.release());
  EXPECT_TRUE(other_mutex.try_lock_for(5s));
  other_mutex.unlock();
}

// A server of a test's own (started by tests/servers/<family>.sh in a fresh directory), for
// what would disturb the suite's shared one: restarts, server-wide counters.
class OwnServer {
 public:
  explicit OwnServer(std::string script) : script_(std::move(script)) {
    char dir[] = "/tmp/turnstile-own-server-XXXXXX";
    if (!mkdtemp(dir)) throw std::runtime_error("mkdtemp failed");
    dir_ = dir;
    if (run("start") != 0) {
      run("stop");  // no destructor runs after a throwing constructor: leave nothing running
      std::filesystem::remove_all(dir_);
      throw std::runtime_error("could not start a server with " + script_);
    }
    url_ = read_first_line(dir_ + "/url");
  }
  ~OwnServer() {
    run("stop");
    std::filesystem::remove_all(dir_);
  }
  OwnServer(const OwnServer&) = delete;
  OwnServer& operator=(const OwnServer&) = delete;
  const std::string& url() const { return url_; }
  // Stops it and starts it again on the same port (with its data where the script keeps it).
  int restart() { return run("restart"); }
  // Stops it; restart() starts it again.
  int stop() { return run("stop"); }
  // Any other action its script knows (e.g. consul.sh's restart-empty, pause, resume), with an
  // argument after the directory when given (redis_sentinel.sh's kill DIR ID).
  int action(const std::string& name, const std::string& argument = "") { return run(name, argument); }
  const std::string& dir() const { return dir_; }

 private:
  int run(const std::string& action, const std::string& argument = "") {
    return std::system(
        (script_ + " " + action + " " + dir_ + (argument.empty() ? "" : " " + argument) + " >/dev/null").c_str());
  }
  std::string script_;
  std::string dir_;
  std::string url_;
};

}  // namespace server_tests
