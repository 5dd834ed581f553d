// What only the etcd backend promises: `etcdctl lock` (Debian's etcd-client) and turnstile's
// Mutex exclude each other both ways, on etcd's own key layout; a waiter paused past its lease
// TTL is told (HoldLost); kill -9 frees a hold within the TTL; an etcd restart
// with its data kept never doubles a hold; URLs are checked.
//
// The restart test starts an etcd of its own (tests/servers/etcd.sh); the others use the
// suite's fixture server, whose URL file is TURNSTILE_ETCD_URL_FILE.
#include <signal.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <random>

#include "conformance/support.hpp"
#include "support/server_tests.hpp"

namespace {

using namespace std::chrono_literals;
using conformance::Child;
using conformance::Pipe;
using turnstile::Client;
using namespace server_tests;

// etcdctl against the server of an etcd:// URL.
std::string etcdctl(const std::string& url, const std::string& arguments) {
  const auto endpoint = "http://" + url.substr(std::string("etcd://").size());
  return std::string("ETCDCTL_API=3 ") + TURNSTILE_ETCDCTL + " --endpoints=" + endpoint + " " + arguments;
}

std::string scratch_file(const std::string& leaf) {
  return std::filesystem::temp_directory_path() / ("turnstile-etcd-test-" + std::to_string(getpid()) + "-" + leaf);
}

class Etcd : public ::testing::Test {
 protected:
  void SetUp() override {
    url_ = read_first_line(TURNSTILE_ETCD_URL_FILE);
    ASSERT_FALSE(url_.empty()) << "no URL in " << TURNSTILE_ETCD_URL_FILE << " (did the etcd_server fixture run?)";
  }
  std::string url_;
};

TEST_F(Etcd, EtcdctlHoldsWhileTurnstileWaits) {
  const auto name = unique_name("interop");
  const auto marker = scratch_file("etcdctl-held");
  const auto finished = marker + ".finished";
  std::filesystem::remove(marker);
  std::filesystem::remove(finished);
  // etcdctl writes its revision (ETCD_LOCK_REV) once it holds, holds for 2 s, and marks the
  // end of its command: it releases only after that.
  auto holder = std::async(std::launch::async, [&] {
    return std::system(etcdctl(url_, "lock " + quoted(name) + " -- sh -c " +
                                         quoted("echo $ETCD_LOCK_REV > " + marker + ".tmp && mv " + marker + ".tmp " +
                                                marker + " && sleep 2 && touch " + finished))
                           .c_str());
  });
  ASSERT_TRUE(eventually([&] { return std::filesystem::exists(marker); })) << "etcdctl lock never held";
  const auto etcdctl_revision = std::stoull(read_first_line(marker));
  auto client = Client::connect(url_);
  auto mutex = client.mutex(name);
  EXPECT_FALSE(mutex.try_lock()) << "turnstile took a lock etcdctl holds";
  ASSERT_TRUE(mutex.try_lock_for(15s));
  EXPECT_TRUE(std::filesystem::exists(finished)) << "turnstile got the lock while etcdctl's command still ran";
  EXPECT_GT(mutex.fencing_token(), etcdctl_revision);
  mutex.unlock();
  EXPECT_EQ(holder.get(), 0);
  std::filesystem::remove(marker);
  std::filesystem::remove(finished);
}

TEST_F(Etcd, TurnstileHoldsWhileEtcdctlWaits) {
  const auto name = unique_name("interop");
  const auto marker = scratch_file("etcdctl-got");
  std::filesystem::remove(marker);
  auto client = Client::connect(url_);
  auto mutex = client.mutex(name);
  mutex.lock();
  // The key is etcd's concurrency.Mutex key: NAME/<lease id in hex>, empty of foreign marks.
  const auto keys = shell(etcdctl(url_, "get --prefix --keys-only " + quoted(name + "/")));
  EXPECT_EQ(keys.rfind(name + "/", 0), 0u) << keys;
  const auto suffix = keys.substr(name.size() + 1);
  EXPECT_EQ(suffix.find_first_not_of("0123456789abcdef"), std::string::npos) << keys;
  auto waiter = std::async(std::launch::async, [&] {
    return std::system(etcdctl(url_, "lock " + quoted(name) + " -- sh -c " + quoted("touch " + marker)).c_str());
  });
  EXPECT_TRUE(eventually([&] { return client.inspect(name).waiters.size() == 1; }, 15s))
      << "etcdctl's key is not listed as a waiter";
  EXPECT_FALSE(std::filesystem::exists(marker)) << "etcdctl lock got a lock turnstile holds";
  mutex.unlock();
  ASSERT_EQ(waiter.wait_for(15s), std::future_status::ready) << "etcdctl lock never got the lock after the release";
  EXPECT_EQ(waiter.get(), 0);
  EXPECT_TRUE(std::filesystem::exists(marker));
  std::filesystem::remove(marker);
}

TEST_F(Etcd, ThreadsOfOneClientNeverShareAKey) {
  // etcd-io/etcd#11360: two Mutexes on one lease share the key and do not exclude each other.
  const auto name = unique_name("threads");
  auto client = Client::connect(url_);
  std::atomic<int> inside{0};
  std::atomic<bool> overlap{false};
  conformance::run_threads(4, [&](int) {
    auto mutex = client.mutex(name);
    for (int i = 0; i < 10; ++i) {
      std::lock_guard guard(mutex);
      if (inside.fetch_add(1) != 0) overlap = true;
      std::this_thread::sleep_for(1ms);
      inside.fetch_sub(1);
    }
  });
  EXPECT_FALSE(overlap.load());
  EXPECT_EQ(shell(etcdctl(url_, "get --prefix --keys-only " + quoted(name + "/"))), "") << "a key was left behind";
}

TEST_F(Etcd, WaiterWhoseLeaseExpiresStopsWithHoldLost) {
  // etcd-io/etcd#19597 and #11456: a waiter whose session died must neither keep waiting nor
  // be granted the lock.
  const auto name = unique_name("waiter");
  auto client = Client::connect(url_);
  auto holder = client.mutex(name);
  holder.lock();
  Pipe waiting, verdict;
  auto child = Child::spawn([&]() -> int {
    auto own = Client::connect(url_, with_ttl(2s));
    auto mutex = own.mutex(name);
    waiting.send();
    try {
      const bool got = mutex.try_lock_for(30s);
      verdict.send(got ? 'G' : 'T');
    } catch (const turnstile::HoldLost&) {
      verdict.send('L');
    }
    return 0;
  });
  ASSERT_TRUE(waiting.receive());
  ASSERT_TRUE(eventually([&] { return client.inspect(name).waiters.size() == 1; }));
  child.kill(SIGSTOP);
  // Its lease expires; its key goes with it.
  EXPECT_TRUE(eventually([&] { return client.inspect(name).waiters.empty(); }, 15s));
  const auto resumed = std::chrono::steady_clock::now();
  child.kill(SIGCONT);
  EXPECT_EQ(verdict.receive(10s), 'L') << "the waiter did not stop with HoldLost";
  EXPECT_LT(std::chrono::steady_clock::now() - resumed, 3s);
  EXPECT_EQ(child.wait(), 0);
  holder.unlock();
}

TEST_F(Etcd, KilledHolderFreesItsHoldWithinTheTtl) {
  // The lease's TTL, plus etcd's check for expired leases every 500 ms and some slack.
  expect_killed_holder_freed_within(url_, 3s, 3s + 1s);
}

TEST_F(Etcd, UrlsAreChecked) {
  EXPECT_THROW(Client::connect("etcd://127.0.0.1:2379?bogus=1"), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect("etcd://127.0.0.1:2379?ttl=0.5"), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect("etcd://127.0.0.1"), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect("etcd://127.0.0.1:2379?cacert=/nonexistent"), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect(url_, with_ttl(500ms)), turnstile::InvalidArgument);
  // Nothing listens on port 1.
  EXPECT_THROW(Client::connect("etcd://127.0.0.1:1"), turnstile::BackendUnavailable);
  // Several endpoints: a dead one first, the live one second.
  auto client = Client::connect("etcd://127.0.0.1:1," + url_.substr(std::string("etcd://").size()));
  auto mutex = client.mutex(unique_name("failover"));
  EXPECT_TRUE(mutex.try_lock());
  mutex.unlock();
}


TEST(EtcdOwnServer, RestartWithDataKeptNeverDoublesAHold) {
  OwnServer server(TURNSTILE_ETCD_SCRIPT);
  const auto name = unique_name("restart");
  auto holder_client = Client::connect(server.url(), with_ttl(3s));
  auto holder = holder_client.mutex(name);
  holder.lock();
  const auto lost = holder.lost_token();
  ASSERT_EQ(server.restart(), 0);
  auto other_client = Client::connect(server.url());
  auto other = other_client.mutex(name);
  // Either the hold survived (and still excludes), or its holder was told before anyone else
  // could take it.
  for (int i = 0; i < 20; ++i) {
    if (other.try_lock()) {
      EXPECT_TRUE(lost.stop_requested()) << "a second holder got in while the first was not told";
      other.unlock();
      break;
    }
    std::this_thread::sleep_for(250ms);
  }
  if (!lost.stop_requested()) {
    EXPECT_NO_THROW(holder.release());
  } else {
    holder.unlock();
  }
}

// A server down for less than the lease's TTL suspends the holds (keep-alives fail), and the
// same lease's holds are held again once etcd is back with its data.
TEST(EtcdOwnServer, ServerDownBrieflySuspendsThenResumesTheHolds) {
  OwnServer server(TURNSTILE_ETCD_SCRIPT);
  expect_outage_suspends_then_resumes(
      server.url(), 30s, [&] { ASSERT_EQ(server.stop(), 0); }, [&] { ASSERT_EQ(server.restart(), 0); });
}

// etcd auth: with auth enabled, the right password works (locks and all), a wrong one and no
// credentials at all are refused at connect time with AccessDenied.
TEST(EtcdOwnServer, AuthRefusesWrongCredentialsAtConnect) {
  OwnServer server(TURNSTILE_ETCD_SCRIPT);
  for (const std::string command : {"user add root:rootpw", "user grant-role root root", "user add alice:secret",
                                    "user grant-role alice root"}) {
    const auto output = shell(etcdctl(server.url(), command));
    ASSERT_TRUE(output.find("created") != std::string::npos || output.find("granted") != std::string::npos)
        << command << ": " << output;
  }
  ASSERT_NE(shell(etcdctl(server.url(), "auth enable")).find("Authentication Enabled"), std::string::npos);
  const auto hostport = server.url().substr(std::string("etcd://").size());
  {
    auto client = Client::connect("etcd://alice:secret@" + hostport);
    auto mutex = client.mutex(unique_name("auth"));
    ASSERT_TRUE(mutex.try_lock_for(10s));
    EXPECT_GT(mutex.fencing_token(), 0u);
    mutex.unlock();
  }
  EXPECT_THROW(Client::connect("etcd://alice:wrong@" + hostport), turnstile::AccessDenied);
  EXPECT_THROW(Client::connect("etcd://nobody:secret@" + hostport), turnstile::AccessDenied);
}

// etcds://: TLS with the CA given by ?cacert= works; the same server is refused over plain
// text, and with the system's trust store (which does not know our test CA).
TEST(EtcdOwnServer, TlsWithAGivenCaWorksAndUntrustedServersAreRefused) {
  char dir[] = "/tmp/turnstile-etcd-tls-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string tls = std::string(dir) + "/tls";
  std::filesystem::create_directory(tls);
  const auto openssl = [&](const std::string& arguments) { return shell("cd " + quoted(tls) + " && openssl " + arguments); };
  openssl("req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=turnstile-test-ca");
  openssl("req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=127.0.0.1");
  shell("printf 'subjectAltName=IP:127.0.0.1\\n' > " + quoted(tls + "/ext.cnf"));
  openssl("x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 -extfile ext.cnf");
  ASSERT_TRUE(std::filesystem::exists(tls + "/server.pem")) << "openssl did not make the certificate";
  struct Server {
    std::string dir;
    ~Server() {
      shell(std::string(TURNSTILE_ETCD_SCRIPT) + " stop " + dir);
      std::filesystem::remove_all(dir);
    }
  } server{dir};
  shell(std::string(TURNSTILE_ETCD_SCRIPT) + " start " + dir);
  const auto url = read_first_line(std::string(dir) + "/url");
  ASSERT_EQ(url.rfind("etcds://", 0), 0u) << url;
  const auto hostport = url.substr(std::string("etcds://").size());
  {
    auto client = Client::connect(url + "?cacert=" + tls + "/ca.pem");
    auto mutex = client.mutex(unique_name("tls"));
    ASSERT_TRUE(mutex.try_lock_for(10s));
    EXPECT_GT(mutex.fencing_token(), 0u);
    mutex.unlock();
  }
  EXPECT_THROW(Client::connect("etcd://" + hostport), turnstile::BackendUnavailable);
  EXPECT_THROW(Client::connect(url), turnstile::BackendUnavailable);
  EXPECT_THROW(Client::connect("etcd://" + hostport + "?cacert=" + tls + "/ca.pem"), turnstile::InvalidUrl);
}

}  // namespace
