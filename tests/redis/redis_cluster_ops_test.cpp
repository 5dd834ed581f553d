// SPDX-License-Identifier: Apache-2.0
// redis+cluster:// as an operator meets it (issue 24, item 13): a first seed that refuses
// connections costs nothing, a server that is no cluster node is refused with a clear error, a
// SIGSTOPped node does not hold a CLI run past its --timeout, and a transient CLUSTERDOWN on the
// CLI's first try is waited out within its --timeout.
//
// Tests that disturb the cluster start one of their own (tests/servers/redis_cluster.sh); the
// others use the suite's fixture (TURNSTILE_REDIS_CLUSTER_URL_FILE).
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <future>
#include <thread>

#include "backends/redis/cluster.hpp"
#include "conformance/support.hpp"
#include "support/server_tests.hpp"

namespace {

using namespace std::chrono_literals;
using turnstile::Client;
using namespace server_tests;
using turnstile::detail::redis::key_slot;
using Clock = std::chrono::steady_clock;

std::string queue_key(const std::string& name) { return "turnstile:{" + name + "}:q"; }

// A loopback port nothing listens on (bound, then closed: connections to it are refused).
int refused_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address);
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  close(fd);
  return ntohs(address.sin_port);
}

std::string hosts_of(const std::string& url) { return url.substr(url.find("//") + 2); }

long long ms_since(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
}

// The CLI's exit status, how long it took, and what it said on stderr.
struct Ran {
  int status;
  long long ms;
  std::string said;
};
Ran run_cli(const std::string& arguments) {
  const auto err = std::filesystem::temp_directory_path() / ("turnstile-cluster-ops-" + std::to_string(getpid()));
  const auto started = Clock::now();
  const int status =
      std::system((std::string(TURNSTILE_CLI_PATH) + " " + arguments + " >/dev/null 2>" + err.string()).c_str());
  Ran ran{WIFEXITED(status) ? WEXITSTATUS(status) : -1, ms_since(started), shell("cat " + err.string())};
  std::filesystem::remove(err);
  return ran;
}

class RedisClusterOps : public ::testing::Test {
 protected:
  void SetUp() override {
    url_ = read_first_line(TURNSTILE_REDIS_CLUSTER_URL_FILE);
    ASSERT_FALSE(url_.empty()) << "no URL in " << TURNSTILE_REDIS_CLUSTER_URL_FILE;
  }
  std::string url_;
};

// Before: a refusing first seed was retried within its share of the connect timeout (with the
// CLI's default 10 s and three nodes named, 2.5 s of every run).
TEST_F(RedisClusterOps, ARefusingFirstSeedIsPassedOverAtOnce) {
  const auto url = "redis+cluster://127.0.0.1:" + std::to_string(refused_port()) + "," + hosts_of(url_);
  turnstile::ClientOptions options;
  options.connect_timeout = 10s;
  const auto started = Clock::now();
  auto client = Client::connect(url, options);
  const auto connected = ms_since(started);
  std::printf("connected in %lld ms with a refusing first seed\n", connected);
  EXPECT_LT(connected, 1000) << "the refusing first seed was retried";
  auto mutex = client.mutex(unique_name("refused-seed"));
  EXPECT_TRUE(mutex.try_lock_for(5s));
  mutex.unlock();
  // Every node refusing: a clear error at once, naming each.
  const auto nobody =
      "redis+cluster://127.0.0.1:" + std::to_string(refused_port()) + ",127.0.0.1:" + std::to_string(refused_port());
  const auto tried = Clock::now();
  try {
    Client::connect(nobody, options);
    ADD_FAILURE() << "refusing nodes connected";
  } catch (const turnstile::BackendUnavailable& error) {
    EXPECT_NE(std::string(error.what()).find("refused"), std::string::npos) << error.what();
  }
  EXPECT_LT(ms_since(tried), 1000) << "refusing nodes were retried";
}

// Before: a standalone server named first was passed over (the next node answered), and could
// then be the node the subscriber listened on, where no wake-up ever arrives.
TEST_F(RedisClusterOps, AServerThatIsNoClusterNodeIsRefusedWithAClearError) {
  OwnServer single{TURNSTILE_REDIS_SCRIPT};
  const auto single_hosts = hosts_of(single.url());
  for (const auto& url :
       {"redis+cluster://" + single_hosts, "redis+cluster://" + single_hosts + "," + hosts_of(url_)}) {
    try {
      Client::connect(url);
      ADD_FAILURE() << url << " connected";
    } catch (const turnstile::BackendUnavailable& error) {
      EXPECT_NE(std::string(error.what()).find("is not a node of a Redis Cluster"), std::string::npos) << error.what();
      EXPECT_NE(std::string(error.what()).find(single_hosts), std::string::npos) << error.what();
    }
  }
}

// The other way round: redis:// naming one node of a cluster. The names its slots serve work;
// the others were refused with a bare "MOVED 3999 127.0.0.1:…", which says nothing of the cause.
TEST_F(RedisClusterOps, ARedisUrlNamingAClusterNodeSaysToUseRedisCluster) {
  const auto hosts = hosts_of(url_);
  const auto first = "redis://" + hosts.substr(0, hosts.find(','));
  auto client = Client::connect(first);
  int redirected = 0;
  for (int i = 0; i < 24 && redirected == 0; ++i) {
    try {
      auto mutex = client.mutex(unique_name("on-a-node") + std::to_string(i));
      if (mutex.try_lock()) mutex.unlock();
    } catch (const turnstile::BackendUnavailable& error) {
      ++redirected;
      EXPECT_NE(std::string(error.what()).find("is a node of a Redis Cluster: use redis+cluster://"), std::string::npos)
          << error.what();
    }
  }
  EXPECT_EQ(redirected, 1) << "no name of 24 was served by another node";
}

// A cluster of a test's own (n1..n6: three primaries with a replica each), driven by its script.
class OwnNodes {
 public:
  const std::string& url() const { return server_.url(); }
  std::string script(const std::string& action, const std::string& argument = "") const {
    return shell(std::string(TURNSTILE_REDIS_CLUSTER_SCRIPT) + " " + action + " " + server_.dir() + " " +
                 quoted(argument));
  }
  std::string cli(const std::string& id, const std::string& arguments) const {
    const auto port = shell("awk '$1 == \"" + id + "\" { print $4 }' " + server_.dir() + "/nodes");
    return shell("redis-cli -h 127.0.0.1 -p " + port + " " + arguments);
  }
  std::string owner(const std::string& key) const { return script("owner", key); }
  std::string name_on(const std::string& on, const std::string& leaf) const {
    for (int i = 0;; ++i) {
      auto name = unique_name(leaf) + std::to_string(i);
      if (owner(queue_key(name)) == on) return name;
    }
  }
  // A name whose slot another primary than `not_on` serves.
  std::string name_not_on(const std::string& not_on, const std::string& leaf) const {
    for (int i = 0;; ++i) {
      auto name = unique_name(leaf) + std::to_string(i);
      if (owner(queue_key(name)) != not_on) return name;
    }
  }

 private:
  OwnServer server_{TURNSTILE_REDIS_CLUSTER_SCRIPT};
};

// Before: the first node named, SIGSTOPped, held each map read at connect for a fair share of
// the connect timeout (a third of 10 s with `inspect`, twice: once per router of the client),
// and the eviction look at slot 0's node for a whole call's share (1.5 s).
TEST(RedisClusterOpsFaults, ASigstoppedFirstNodeDoesNotHoldTheCliPastItsTimeout) {
  OwnNodes nodes;
  const auto stopped = nodes.name_on("n1", "stopped");
  const auto elsewhere = nodes.name_not_on("n1", "elsewhere");
  ASSERT_EQ(nodes.script("pause", "n1"), "");
  struct Resume {
    const OwnNodes& nodes;
    ~Resume() { nodes.script("resume", "n1"); }
  } resume{nodes};
  // At once, before the cluster (node timeout 1 s) fails n1 over.
  const auto ran =
      run_cli("run --backend " + quoted(nodes.url()) + " --timeout 2 --lock " + quoted(stopped) + " -- true");
  std::printf("exit %d after %lld ms with the name's primary stopped: %s\n", ran.status, ran.ms, ran.said.c_str());
  // The try's own floor and, at exit, the second a client gives its unanswered retirements
  // (docs/backends/redis.md) may come on top; a stopped node's handshake no more.
  EXPECT_LT(ran.ms, 3500) << "--timeout 2 overrun";
  const auto inspected = run_cli("inspect --backend " + quoted(nodes.url()) + " " + quoted(elsewhere));
  std::printf("inspect: exit %d after %lld ms with the first node stopped\n", inspected.status, inspected.ms);
  EXPECT_EQ(inspected.status, 0);
  EXPECT_LT(inspected.ms, 1500) << "the stopped first node held the connect";
}

// Before: the CLI's first try (made before it waits) ended the run with exit 69 on CLUSTERDOWN,
// which passes once the slot is served again; lock() waits it out.
TEST(RedisClusterOpsFaults, ATransientClusterDownOnTheFirstTryIsWaitedOut) {
  OwnNodes nodes;
  const auto name = nodes.name_not_on("", "down");
  const auto primary = nodes.owner(queue_key(name));
  const auto slot = std::to_string(key_slot(queue_key(name)));
  // The primary forgets it serves the slot: it answers CLUSTERDOWN (not served) to every call on
  // it, while the other nodes still send every client there.
  ASSERT_EQ(nodes.cli(primary, "CLUSTER DELSLOTS " + slot), "OK");
  ASSERT_NE(nodes.cli(primary, "SET " + quoted(queue_key(name)) + " x").find("CLUSTERDOWN"), std::string::npos);
  auto back = std::async(std::launch::async, [&] {
    std::this_thread::sleep_for(2500ms);
    return nodes.cli(primary, "CLUSTER ADDSLOTS " + slot);
  });
  const auto ran =
      run_cli("run --backend " + quoted(nodes.url()) + " --timeout 20 --lock " + quoted(name) + " -- true");
  EXPECT_EQ(back.get(), "OK");
  std::printf("exit %d after %lld ms (the slot served again after 2.5 s)\n", ran.status, ran.ms);
  EXPECT_EQ(ran.status, 0) << "a transient CLUSTERDOWN ended the run";
  EXPECT_GE(ran.ms, 2000) << "held before the slot was served again";
}

// Before: the subscriber listened on the URL's nodes in turn, so with the first node killed it
// moved to a standalone server named second, where no wake-up ever arrives (the waiter then
// waited for its periodic look). Now it listens on the slot map's primaries.
TEST(RedisClusterOpsFaults, TheSubscriberNeverListensOnAServerOutsideTheCluster) {
  OwnNodes nodes;
  OwnServer single{TURNSTILE_REDIS_SCRIPT};
  const auto single_port = single.url().substr(single.url().rfind(':') + 1);
  const auto hosts = hosts_of(nodes.url());
  const auto first = hosts.substr(0, hosts.find(','));
  // n1 first (it answers the connect's map read), then the standalone server, then the others.
  const auto url = "redis+cluster://" + first + "," + hosts_of(single.url()) + hosts.substr(hosts.find(','));
  const auto name = nodes.name_not_on("n1", "outside");
  const auto channel = "turnstile:{" + name + "}:w:0";
  const auto listeners = [&](const std::string& port) {
    return shell("redis-cli -p " + port + " PUBSUB NUMSUB " + quoted(channel));
  };
  auto holder = Client::connect(url);
  auto waiting = Client::connect(url);
  auto mutex = holder.mutex(name);
  mutex.lock();
  auto theirs = waiting.mutex(name);
  auto waiter = lock_in_background(theirs, 60s);
  ASSERT_TRUE(eventually([&] { return waiting.inspect(name).waiters.size() == 1; }, 10s));
  ASSERT_EQ(nodes.script("kill", "n1"), "");
  // The subscription moved off n1: to a node of the cluster, never to the standalone server.
  ASSERT_TRUE(eventually(
      [&] {
        for (const auto* id : {"n2", "n3", "n4", "n5", "n6"}) {
          if (nodes.cli(id, "PUBSUB NUMSUB " + quoted(channel)) == channel + "\n1") return true;
        }
        return listeners(single_port) == channel + "\n1";
      },
      20s));
  EXPECT_EQ(listeners(single_port), channel + "\n0") << "the subscriber listens on a server outside the cluster";
  EXPECT_EQ(waiter.wait_for(0s), std::future_status::timeout) << "a waiter got in while the lock was held";
  mutex.unlock();
  EXPECT_TRUE(waiter.get());
}

}  // namespace
