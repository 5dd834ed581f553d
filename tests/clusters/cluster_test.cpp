// SPDX-License-Identifier: Apache-2.0
// Fail-over on real 3-node clusters (issue 14): a ZooKeeper ensemble and an etcd cluster, each
// started by its CTest fixture (tests/servers/zookeeper_ensemble.sh, etcd_cluster.sh) and
// driven through the script's control commands: kill -9 of a follower and of the leader, the
// leader paused (SIGSTOP) past the session TTL, members restarted with and without their data.
//
// What must hold, through the public API only:
//  * a holder whose URL lists every node keeps its hold through the fault, or is told it lost
//    it (lost_token), and a waiting contender is never admitted before one of the two (the
//    hold-history checker proves it: the holder's recorded hold ends at its release or at the
//    moment it was told lost, whichever came first);
//  * after the fault, the waiter gets the lock within a bound of the release, and a fresh
//    client acquires within a bound;
//  * a restarted member rejoins (the script's `healthy`), knows the holds the others granted
//    while it was down (wiped or not), and serves locks.
#include <signal.h>
#include <sys/types.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <sstream>

#include "support/server_tests.hpp"
#include "testing/hold_history.hpp"

namespace {

using namespace std::chrono_literals;
using namespace server_tests;
using turnstile::Client;
using turnstile::HoldState;
namespace th = turnstile::testing;
using Clock = std::chrono::steady_clock;

struct ClusterParam {
  std::string fixture;  // zookeeper_ensemble or etcd_cluster
  std::string script;
  std::string dir;
};

void PrintTo(const ClusterParam& param, std::ostream* out) { *out << param.fixture; }

// TURNSTILE_TEST_CLUSTERS: "fixture=script=dir|…", one per cluster fixture CMake registered.
std::vector<ClusterParam> cluster_params() {
  std::vector<ClusterParam> params;
  std::stringstream all(TURNSTILE_TEST_CLUSTERS);
  std::string entry;
  while (std::getline(all, entry, '|')) {
    const auto first = entry.find('=');
    const auto second = entry.find('=', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    params.push_back({entry.substr(0, first), entry.substr(first + 1, second - first - 1), entry.substr(second + 1)});
  }
  return params;
}

struct Node {
  int id = 0;
  std::string host;
  int port = 0;
  pid_t pid = 0;
};

long long ms_since(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
}

class ClusterTest : public ::testing::TestWithParam<ClusterParam> {
 protected:
  void SetUp() override {
    url_ = read_first_line(dir() + "/url");
    ASSERT_FALSE(url_.empty()) << "no URL in " << dir() << "/url (did the " << GetParam().fixture << " fixture run?)";
    scheme_ = url_.substr(0, url_.find("://"));
    restore();
    ASSERT_TRUE(healthy()) << "the cluster is not healthy before the test";
  }
  // Whatever a failed test left behind: paused nodes resumed, killed ones started again.
  void TearDown() override {
    restore();
    EXPECT_TRUE(healthy()) << "the cluster did not heal after the test";
  }

  const std::string& dir() const { return GetParam().dir; }

  // Runs `SCRIPT ACTION DIR [ID] [EXTRA]`; returns its exit status.
  int control(const std::string& action, int id = 0, const std::string& extra = "") const {
    std::string command = quoted(GetParam().script) + " " + action + " " + quoted(dir());
    if (id != 0) command += " " + std::to_string(id);
    if (!extra.empty()) command += " " + extra;
    command += " >>" + quoted(dir() + "/control.log") + " 2>&1";
    const int status = std::system(command.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  bool healthy() const { return control("healthy") == 0; }
  bool eventually_healthy(std::chrono::milliseconds timeout = 30s) const {
    return eventually([&] { return healthy(); }, timeout);
  }
  // The leader's ID, 0 when none (asked until one answers, up to 10 s).
  int leader() const {
    int found = 0;
    eventually(
        [&] {
          const auto output = shell(quoted(GetParam().script) + " leader " + quoted(dir()) + " 2>/dev/null");
          found = output.empty() ? 0 : std::atoi(output.c_str());
          return found != 0;
        },
        10s);
    return found;
  }
  int follower() const {
    const int lead = leader();
    return lead == 1 ? 2 : 1;
  }

  std::vector<Node> nodes() const {
    std::vector<Node> result;
    std::ifstream file(dir() + "/nodes");
    Node node;
    while (file >> node.id >> node.host >> node.port >> node.pid) result.push_back(node);
    return result;
  }
  static bool alive(pid_t pid) { return pid > 0 && ::kill(pid, 0) == 0; }

  void restore() const {
    for (const auto& node : nodes()) {
      if (alive(node.pid)) {
        control("resume", node.id);
      } else {
        control("start-node", node.id);
      }
    }
    eventually_healthy(60s);
  }

  // The cluster's URL with node `first` listed first (the client starts there, as far as its
  // backend follows the order), or only node `only`.
  std::string url_starting_at(int first) const {
    std::string hosts;
    auto all = nodes();
    std::stable_partition(all.begin(), all.end(), [&](const Node& node) { return node.id == first; });
    for (const auto& node : all) hosts += (hosts.empty() ? "" : ",") + node.host + ":" + std::to_string(node.port);
    return scheme_ + "://" + hosts;
  }
  std::string url_of_only(int id) const {
    for (const auto& node : nodes()) {
      if (node.id == id) return scheme_ + "://" + node.host + ":" + std::to_string(node.port);
    }
    return {};
  }

  // A holder (TTL `ttl`, its URL starting at node `victim`) holds a Mutex while a contender (its
  // URL ending at `victim`) waits; `fault` happens; for `observe` the contender must not be
  // admitted unless the holder was told it lost its hold; `after` runs (the fault ends); the
  // holder releases; the contender must get the lock within 15 s of that, and a new client
  // within 10 s. The history of both holds is checked.
  // `engine_late_loss`: when not zero, the engine is known to revoke a live lease now and then
  // under this fault; a contender admitted before the holder was told is then accepted only
  // if the holder is told within that bound after it (reported, never silent).
  void hold_through(int victim, std::chrono::milliseconds ttl, const std::function<void()>& fault,
                    std::chrono::milliseconds observe, const std::function<void()>& after,
                    std::chrono::milliseconds engine_late_loss = 0ms) {
    const auto name = unique_name("failover");
    th::HoldRecorder history;
    HoldStateLog log;
    auto holder_client = Client::connect(url_starting_at(victim), log.options(ttl));
    auto contender_url = url_starting_at(victim == 3 ? 1 : victim + 1);
    auto contender_client = Client::connect(contender_url, with_ttl(ttl));

    auto mutex = holder_client.mutex(name);
    mutex.lock();
    const auto held_ns = th::monotonic_ns();
    const auto token = mutex.fencing_token();
    std::atomic<std::int64_t> lost_ns{0};
    std::stop_callback on_lost(mutex.lost_token(), [&] { lost_ns = th::monotonic_ns(); });

    std::atomic<std::int64_t> admitted_ns{0};
    auto contender = std::async(std::launch::async, [&] {
      auto other = contender_client.mutex(name);
      const auto requested = th::monotonic_ns();
      bool got = false;
      try {
        got = other.try_lock_for(90s);
      } catch (const turnstile::Error& error) {
        ADD_FAILURE() << "the contender's acquire failed: " << error.what();
        return false;
      }
      if (!got) return false;
      admitted_ns = th::monotonic_ns();
      th::HoldRecord record{name, "exclusive", 1, other.fencing_token(), admitted_ns.load(), 0};
      std::this_thread::sleep_for(100ms);
      record.end_ns = th::monotonic_ns();
      record.request_ns = requested;
      history.record(record);
      other.unlock();
      return true;
    });
    // Proof that the contender really waits (so that "not admitted" below means something).
    ASSERT_TRUE(eventually([&] { return contender_client.inspect(name).waiters.size() == 1; }, 15s))
        << "the contender never queued";
    ASSERT_EQ(contender.wait_for(0s), std::future_status::timeout);

    const auto fault_ns = th::monotonic_ns();
    fault();
    // Observe: the contender is admitted only after the holder was told lost.
    bool judged = false, engine_revoked = false;
    // Once the contender is admitted (during the fault or as it ends): the holder must have
    // been told before, or, where the engine may revoke a live lease, within the bound after.
    const auto judge_admission = [&] {
      if (judged || admitted_ns.load() == 0) return;
      judged = true;
      if (engine_late_loss > 0ms && (lost_ns.load() == 0 || lost_ns.load() > admitted_ns.load())) {
        EXPECT_TRUE(eventually([&] { return lost_ns.load() != 0; }, engine_late_loss))
            << "the contender was admitted and the holder was not told within " << engine_late_loss.count() << " ms";
        const auto late_ms = (lost_ns.load() - admitted_ns.load()) / 1000000;
        EXPECT_LE(late_ms, engine_late_loss.count());
        engine_revoked = lost_ns.load() != 0;
        std::printf(
            "[%s] the engine revoked a live lease: the holder was told %lld ms after the contender was "
            "admitted (etcd-io/etcd#15247, see docs/backends/etcd.md)\n",
            GetParam().fixture.c_str(), static_cast<long long>(late_ms));
        return;
      }
      EXPECT_NE(lost_ns.load(), 0) << "the contender was admitted while the holder was never told it lost";
      EXPECT_LT(lost_ns.load(), admitted_ns.load()) << "the contender was admitted before the holder was told";
    };
    const auto observe_until = Clock::now() + observe;
    while (Clock::now() < observe_until && admitted_ns.load() == 0) std::this_thread::sleep_for(20ms);
    judge_admission();
    after();
    judge_admission();

    // The holder's hold ends now (before the release), or when it was told lost (or, when the
    // engine revoked its live lease, checked above, when the contender was admitted).
    const auto released_ns = th::monotonic_ns();
    const auto lost = engine_revoked ? admitted_ns.load() : lost_ns.load();
    history.record({name, "exclusive", 1, token, held_ns, lost != 0 ? lost : released_ns});
    try {
      mutex.release();
    } catch (const turnstile::Error& error) {
      if (lost == 0 && !mutex.lost_token().stop_requested()) {
        ADD_FAILURE() << "release failed though the hold was never told lost: " << error.what();
      }
    }
    ASSERT_EQ(contender.wait_for(15s), std::future_status::ready) << "the waiter never got the freed lock";
    EXPECT_TRUE(contender.get());
    std::printf("[%s] holder states:", GetParam().fixture.c_str());
    for (auto state : log.states_of(name)) std::printf(" %s", turnstile::to_string(state));
    std::printf("; %s; contender admitted %lld ms after the fault (%lld ms after the release)\n",
                lost != 0 ? "told lost" : "never lost",
                static_cast<long long>((admitted_ns.load() - fault_ns) / 1000000),
                static_cast<long long>((admitted_ns.load() - released_ns) / 1000000));
    const auto violations = th::check(history.records());
    EXPECT_TRUE(violations.empty()) << th::describe(violations);

    // A new acquire on the cluster after the fault succeeds within a bound.
    const auto start = Clock::now();
    auto fresh = Client::connect(url_, with_ttl(ttl));
    auto again = fresh.mutex(name);
    EXPECT_TRUE(again.try_lock_for(10s)) << "no acquire within 10 s after the fault";
    std::printf("[%s] a new client acquired in %lld ms\n", GetParam().fixture.c_str(), ms_since(start));
    if (again.owns_lock()) again.unlock();
  }

  // Kills node `victim` while a lock is held, starts it again (wiping its data or not), and
  // checks that it rejoins and serves: a client that knows only that node sees the hold taken
  // while it was down, and gets the lock once it is released.
  void restart_rejoins(int victim, bool wipe) {
    const auto name = unique_name("restart");
    auto client = Client::connect(url_starting_at(victim == 3 ? 1 : victim + 1), with_ttl(10s));
    ASSERT_EQ(control("kill", victim), 0);
    auto mutex = client.mutex(name);
    ASSERT_TRUE(mutex.try_lock_for(30s)) << "no lock from the two remaining nodes";
    const auto start = Clock::now();
    ASSERT_EQ(control("start-node", victim, wipe ? "wipe" : ""), 0) << "node " << victim << " did not start";
    ASSERT_TRUE(eventually_healthy()) << "node " << victim << " did not rejoin";
    std::printf("[%s] node %d %s rejoined in %lld ms\n", GetParam().fixture.c_str(), victim,
                wipe ? "without its data" : "with its data", ms_since(start));

    auto only = Client::connect(url_of_only(victim), with_ttl(10s));
    auto there = only.mutex(name);
    EXPECT_FALSE(there.try_lock_for(1s)) << "the restarted node does not know the hold taken while it was down";
    const auto held_token = mutex.fencing_token();
    std::atomic<bool> got{false};
    auto waiter = std::async(std::launch::async, [&] {  // holds belong to the thread
      auto waiting = only.mutex(name);
      if (!waiting.try_lock_for(30s)) return false;
      got = true;
      EXPECT_GT(waiting.fencing_token(), held_token);
      waiting.unlock();
      return true;
    });
    ASSERT_TRUE(eventually([&] { return client.inspect(name).waiters.size() == 1; }, 10s));
    EXPECT_FALSE(got.load());
    mutex.unlock();
    ASSERT_EQ(waiter.wait_for(15s), std::future_status::ready);
    EXPECT_TRUE(waiter.get()) << "the restarted node's client never got the freed lock";
  }

  std::string url_;
  std::string scheme_;
};

TEST_P(ClusterTest, HolderSurvivesAFollowerKilled) {
  const int victim = follower();
  hold_through(
      victim, 4s, [&] { ASSERT_EQ(control("kill", victim), 0); }, 6s,
      [&] { ASSERT_EQ(control("start-node", victim), 0); });
}

TEST_P(ClusterTest, HolderSurvivesTheLeaderKilled) {
  const int victim = leader();
  ASSERT_NE(victim, 0);
  hold_through(
      victim, 4s, [&] { ASSERT_EQ(control("kill", victim), 0); }, 6s,
      [&] {
        EXPECT_NE(leader(), 0) << "no new leader";
        ASSERT_EQ(control("start-node", victim), 0);
      });
}

// The leader stopped for longer than the holder's TTL (2 s), then resumed: a new leader is
// elected meanwhile; whatever happens to the holder's session, no two holders.
// etcd 3.4.23 (Debian's) has etcd-io/etcd#15247, in two parts: (1) the resumed stale leader
// answers lease keep-alives with a positive TTL after the new leader took over; the backend now
// confirms a keep-alive only when a linearizable read is served in its term, so that alone no
// longer makes two holders; (2) the resumed stale leader revokes leases that expired by its own
// stopped clock, and its proposals are forwarded to the new leader, which applies them: a live,
// renewed lease is revoked, and the contender is admitted a few milliseconds before the holder
// hears of it (seen in about 1 run in 10 here). No client can prevent (2); upstream fixed it
// (etcd-io/etcd#16822, backported to 3.4 and 3.5). On etcd the test accepts it when the holder
// is told within 1 s, and says so.
TEST_P(ClusterTest, LeaderPausedPastTheSessionTtlNeverMakesTwoHolders) {
  const int victim = leader();
  ASSERT_NE(victim, 0);
  hold_through(
      victim, 2s, [&] { ASSERT_EQ(control("pause", victim), 0); }, 5s,
      [&] {
        ASSERT_EQ(control("resume", victim), 0);
        EXPECT_TRUE(eventually_healthy()) << "the resumed leader did not rejoin";
      },
      scheme_ == "etcd" ? 1s : 0ms);
}

TEST_P(ClusterTest, FollowerRestartedWithItsDataRejoinsAndServes) { restart_rejoins(follower(), false); }

TEST_P(ClusterTest, LeaderRestartedWithoutItsDataRejoinsAndServes) {
  const int victim = leader();
  ASSERT_NE(victim, 0);
  restart_rejoins(victim, true);
}

// 22.1 (etcd): the follower a client talks to is paused while the client's joins are in flight;
// the client resends them to another member, holds and releases; the follower resumes and
// passes on the copies it had read. Before, such a copy re-created the entry on the client's
// live lease (4 of 12 runs with one join): a Mutex, or a Semaphore's permits, held by nobody for
// as long as the client lived. A copy survives gRPC's reset of its stream only now and then, so
// two rounds of 12 joins each (the old code failed 2 of 3 runs with one round).
TEST_P(ClusterTest, JoinHeldUpInAPausedFollowerNeverComesBackAfterTheRelease) {
  if (scheme_ != "etcd") GTEST_SKIP() << "ZooKeeper closes a session's old connection when it reconnects";
  ErrorReports reports;
  auto observer = Client::connect(url_, with_ttl(10s));
  for (int round = 0; round < 2 && !HasFailure(); ++round) {
    std::vector<std::string> names;
    for (int i = 0; i < 12; ++i) names.push_back(unique_name("late-join-" + std::to_string(i)));
    const int victim = follower();
    auto client = Client::connect(url_starting_at(victim), reports.options(10s));
    ASSERT_EQ(control("pause", victim), 0);
    const auto held = hold_and_release_each(client, names, 10s);
    ASSERT_EQ(control("resume", victim), 0);
    EXPECT_EQ(held, names.size()) << "not every join held while one follower was paused";
    ASSERT_TRUE(eventually_healthy()) << "the resumed follower did not rejoin";
    std::this_thread::sleep_for(500ms);  // its copies reach the leader
    EXPECT_EQ(names_with_entries(observer, names), "") << "round " << round << ": late joins re-created these entries";
  }
  EXPECT_EQ(reports.all(), "") << "unexpected reports to the error handler";
}

// Red team F4 (etcd): the member a client talks to is paused. Before, a release got one call
// attempt's time (2 s, all of it spent on the paused member), never reached a healthy one and was
// reported failed; and a call's error named every endpoint although it tried only one. Now a
// release has room for one fail-over, and an error names the endpoints its call went to.
TEST_P(ClusterTest, ReleaseFailsOverFromAPausedMember) {
  if (scheme_ != "etcd") GTEST_SKIP() << "etcd's time limits";
  ErrorReports reports;
  const int victim = follower();
  auto holder = Client::connect(url_starting_at(victim), reports.options(10s));
  auto reader = Client::connect(url_starting_at(victim), with_ttl(10s));
  auto observer = Client::connect(url_, with_ttl(10s));
  const auto name = unique_name("release-fails-over");
  auto mutex = holder.mutex(name);
  ASSERT_TRUE(mutex.try_lock_for(5s));
  ASSERT_EQ(control("pause", victim), 0);
  mutex.unlock();
  EXPECT_EQ(reports.all(), "") << "the release did not reach a healthy member";
  EXPECT_TRUE(observer.inspect(name).holders.empty()) << "the name is still held after its release";
  std::string message;
  try {
    reader.permit_counter(name + "-counter").try_acquire_for(300ms, 1);
  } catch (const turnstile::BackendUnavailable& error) {
    message = error.what();
  }
  ASSERT_EQ(control("resume", victim), 0);
  ASSERT_NE(message, "") << "a read from the paused member alone did not fail";
  for (const auto& node : nodes()) {
    const auto endpoint = node.host + ":" + std::to_string(node.port);
    EXPECT_EQ(message.find(endpoint) != std::string::npos, node.id == victim)
        << endpoint << " in \"" << message << "\" (only " << victim << " was tried)";
  }
}

INSTANTIATE_TEST_SUITE_P(Cluster, ClusterTest, ::testing::ValuesIn(cluster_params()),
                         [](const ::testing::TestParamInfo<ClusterParam>& info) { return info.param.fixture; });

}  // namespace
