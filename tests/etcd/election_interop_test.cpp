// SPDX-License-Identifier: Apache-2.0
// turnstile's Election and etcd's concurrency.Election, as Debian's `etcdctl elect` (3.4.23)
// drives it, elect one leader among them on one key layout (design27.md §5, etcd (a)-(f)):
// NAME/<lease hex> holding the candidate's value, the lowest create revision leading. etcdctl
// runs as a child whose output goes to a file; it resigns on SIGINT (never killed: its 60 s
// lease would keep its key).
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <optional>
#include <regex>
#include <sstream>
#include <thread>
#include <vector>

#include "conformance/support.hpp"
#include "support/server_tests.hpp"

namespace {

using namespace std::chrono_literals;
using conformance::Child;
using turnstile::Client;
using namespace server_tests;

// A shell command running etcdctl against the server of an etcd:// URL (etcdctl itself, in
// place of the shell, after `exec`).
std::string etcdctl_command(const std::string& url, const std::string& arguments) {
  const auto endpoint = "http://" + url.substr(std::string("etcd://").size());
  return std::string("export ETCDCTL_API=3; exec ") + TURNSTILE_ETCDCTL + " --endpoints=" + endpoint + " " + arguments;
}

// An etcdctl command in the background, its output (both streams) in a file of its own.
class Etcdctl {
 public:
  Etcdctl(const std::string& url, const std::string& arguments)
      : output_(std::filesystem::temp_directory_path() /
                ("turnstile-etcd-elect-" + std::to_string(getpid()) + "-" + std::to_string(++count_))),
        child_(
            Child::spawn([command = etcdctl_command(url, arguments) + " > " + server_tests::quoted(output_) + " 2>&1"] {
              execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
              return 127;
            })) {}
  ~Etcdctl() {
    if (child_.running()) interrupt();
    std::filesystem::remove(output_);
  }

  std::vector<std::string> lines() const {
    std::ifstream file(output_);
    std::vector<std::string> result;
    for (std::string line; std::getline(file, line);) result.push_back(line);
    return result;
  }
  // What it printed so far, for failure messages.
  std::string text() const {
    std::string all;
    for (const auto& line : lines()) all += line + "\n";
    return all;
  }
  // Waits until it printed `count` lines; returns them all.
  std::vector<std::string> wait_for_lines(std::size_t count, std::chrono::milliseconds timeout = 10s) const {
    eventually([&] { return lines().size() >= count; }, timeout);
    return lines();
  }
  // etcdctl elect resigns (and an observer ends) on SIGINT; its exit status.
  int interrupt() {
    child_.kill(SIGINT);
    return child_.wait(10s);
  }

 private:
  static inline int count_ = 0;
  std::string output_;
  Child child_;
};

class EtcdElection : public ::testing::Test {
 protected:
  void SetUp() override {
    url_ = read_first_line(TURNSTILE_ETCD_URL_FILE);
    ASSERT_FALSE(url_.empty()) << "no URL in " << TURNSTILE_ETCD_URL_FILE << " (did the etcd_server fixture run?)";
  }
  // The keys under NAME/ and their values, as `etcdctl get --prefix` prints them.
  std::vector<std::string> stored(const std::string& name) const {
    std::istringstream listing(shell(etcdctl_command(url_, "get --prefix " + server_tests::quoted(name + "/"))));
    std::vector<std::string> lines;
    for (std::string line; std::getline(listing, line);) lines.push_back(line);
    return lines;
  }
  // Whether `count` candidates' keys are under NAME/.
  bool candidates(const std::string& name, std::size_t count) const {
    return eventually([&] { return stored(name).size() == 2 * count; });
  }
  std::string url_;
};

bool is_key_of(const std::string& line, const std::string& name) {
  return std::regex_match(
      line, std::regex(std::regex_replace(name, std::regex(R"([.^$|()\[\]{}*+?\\])"), R"(\$&)") + "/[0-9a-f]+"));
}

// (a) etcdctl leads: turnstile's campaign times out and reads etcdctl's value as the leader's;
// (b) etcdctl's resign (SIGINT) makes the waiting turnstile candidate lead; (c) its key is
// NAME/<its lease hex> holding exactly its value, and no other key is under NAME/.
TEST_F(EtcdElection, EtcdctlLeadsTurnstileWaitsThenLeadsWithConcurrencyElectionsKey) {
  const auto name = unique_name("elect-a");
  auto client = Client::connect(url_);
  Etcdctl leader(url_, "elect " + server_tests::quoted(name) + " p1");
  const auto printed = leader.wait_for_lines(2);
  ASSERT_EQ(printed.size(), 2u) << "etcdctl elect did not lead: " << leader.text();
  EXPECT_TRUE(is_key_of(printed[0], name)) << printed[0];
  EXPECT_EQ(printed[1], "p1");

  auto election = client.election(name);
  EXPECT_FALSE(election.campaign_for("t1", 1s)) << "turnstile led while etcdctl elect led";
  ASSERT_TRUE(election.leader());
  EXPECT_EQ(election.leader()->value, "p1");
  EXPECT_FALSE(election.leader()->ours);
  EXPECT_EQ(stored(name).size(), 2u) << "the timed-out campaign left its key";

  auto campaign = std::async(std::launch::async, [&] { return election.campaign_for("t1", 20s); });
  ASSERT_TRUE(candidates(name, 2)) << "turnstile's candidate never queued";
  EXPECT_EQ(campaign.wait_for(500ms), std::future_status::timeout) << "turnstile led while etcdctl elect led";
  EXPECT_EQ(leader.interrupt(), 0) << "etcdctl elect did not resign cleanly";
  ASSERT_EQ(campaign.wait_for(10s), std::future_status::ready) << "turnstile never led after etcdctl resigned";
  ASSERT_TRUE(campaign.get());
  EXPECT_TRUE(election.is_leader());

  const auto keys = stored(name);
  ASSERT_EQ(keys.size(), 2u);
  EXPECT_TRUE(is_key_of(keys[0], name)) << keys[0];
  EXPECT_EQ(keys[1], "t1") << "the value is not stored raw, as concurrency.Election stores it";
  EXPECT_EQ(election.leader()->value, "t1");
  EXPECT_TRUE(election.leader()->ours);
  election.resign();
  EXPECT_TRUE(stored(name).empty()) << "the resign left a key";
}

// (d) `etcdctl elect -l` sees turnstile's leader and its proclaim: the same key with the new
// value. The proclaim is no loss for the leader itself (its held-key watcher sees its own put).
TEST_F(EtcdElection, EtcdctlObserverSeesTurnstilesLeaderAndItsProclaim) {
  const auto name = unique_name("elect-d");
  auto client = Client::connect(url_);
  auto election = client.election(name);
  ASSERT_TRUE(election.campaign_for("t1", 5s));
  Etcdctl observer(url_, "elect -l " + server_tests::quoted(name));
  auto printed = observer.wait_for_lines(2);
  ASSERT_EQ(printed.size(), 2u) << "etcdctl elect -l saw no leader: " << observer.text();
  EXPECT_TRUE(is_key_of(printed[0], name)) << printed[0];
  EXPECT_EQ(printed[1], "t1");

  election.proclaim("t2");
  printed = observer.wait_for_lines(4);
  ASSERT_EQ(printed.size(), 4u) << "etcdctl elect -l did not see the proclaim";
  EXPECT_EQ(printed[2], printed[0]) << "the proclaim wrote another key";
  EXPECT_EQ(printed[3], "t2");
  EXPECT_EQ(election.leader()->value, "t2");
  // The watcher's verdict on the put comes within milliseconds; a second is ample.
  std::this_thread::sleep_for(1s);
  EXPECT_EQ(election.hold_state(), turnstile::HoldState::held) << "the leader's own proclaim read as a loss";
  EXPECT_FALSE(election.lost_token().stop_requested());
  observer.interrupt();
  election.resign();
}

// (e) A waiting `etcdctl elect` prints nothing while turnstile leads, and leads (prints its key
// and value) once turnstile resigns.
TEST_F(EtcdElection, EtcdctlCandidateLeadsOnlyAfterTurnstileResigns) {
  const auto name = unique_name("elect-e");
  auto client = Client::connect(url_);
  auto election = client.election(name);
  ASSERT_TRUE(election.campaign_for("t1", 5s));
  Etcdctl candidate(url_, "elect " + server_tests::quoted(name) + " p2");
  ASSERT_TRUE(candidates(name, 2)) << "etcdctl elect never queued";
  std::this_thread::sleep_for(1s);
  EXPECT_TRUE(candidate.lines().empty()) << "etcdctl elect led while turnstile led";
  EXPECT_EQ(election.leader()->value, "t1");
  election.resign();
  const auto printed = candidate.wait_for_lines(2);
  ASSERT_EQ(printed.size(), 2u) << "etcdctl elect never led after turnstile resigned";
  EXPECT_TRUE(is_key_of(printed[0], name)) << printed[0];
  EXPECT_EQ(printed[1], "p2");
  EXPECT_EQ(client.election(name).leader()->value, "p2");
  EXPECT_EQ(candidate.interrupt(), 0);
}

// (f) `etcdctl lease revoke` of turnstile's lease: turnstile's leadership is lost at once, and
// the waiting etcdctl leads.
TEST_F(EtcdElection, RevokedLeaseLosesTurnstilesLeadershipAndEtcdctlLeads) {
  const auto name = unique_name("elect-f");
  auto client = Client::connect(url_, with_ttl(30s));
  auto election = client.election(name);
  ASSERT_TRUE(election.campaign_for("t1", 5s));
  const auto lost = election.lost_token();
  const auto key = stored(name).at(0);
  Etcdctl candidate(url_, "elect " + server_tests::quoted(name) + " p2");
  ASSERT_TRUE(candidates(name, 2)) << "etcdctl elect never queued";
  const auto lease = key.substr(name.size() + 1);
  ASSERT_NE(shell(etcdctl_command(url_, "lease revoke " + lease)).find("revoked"), std::string::npos);
  EXPECT_TRUE(eventually([&] { return lost.stop_requested(); }, 5s)) << "turnstile's leader was not told";
  const auto printed = candidate.wait_for_lines(2);
  ASSERT_EQ(printed.size(), 2u) << "etcdctl elect never led after the revoke";
  EXPECT_EQ(printed[1], "p2");
  EXPECT_THROW(election.proclaim("t3"), turnstile::HoldLost);
  EXPECT_EQ(candidate.interrupt(), 0);
}

// An `etcdctl lock NAME` at the head of the queue reads, on etcd, as a candidate with an empty
// value (etcd's lock and election are one algorithm): reading the leader while a turnstile
// candidate waits behind it shows it as the foreign leader. Before, the read failed with
// KindMismatch ("in use as a lock"), and so did `turnstile leader NAME --watch`.
TEST_F(EtcdElection, EtcdctlLockAheadOfACandidateReadsAsTheLeader) {
  const auto name = unique_name("elect-lock");
  auto client = Client::connect(url_);
  Etcdctl lock(url_, "lock " + server_tests::quoted(name));
  ASSERT_FALSE(lock.wait_for_lines(1).empty()) << "etcdctl lock did not hold";
  auto election = client.election(name);
  auto campaign = std::async(std::launch::async, [&] { return election.campaign_for("t1", 20s); });
  // (candidates() counts printed lines: the lock's empty value prints none)
  ASSERT_TRUE(eventually([&] { return client.inspect(name).waiters.size() == 1; }))
      << "turnstile's candidate never queued";
  std::optional<turnstile::Leader> leader;
  ASSERT_NO_THROW(leader = client.election(name).leader());
  ASSERT_TRUE(leader);
  EXPECT_EQ(leader->value, "");
  EXPECT_FALSE(leader->ours);
  EXPECT_EQ(campaign.wait_for(500ms), std::future_status::timeout) << "turnstile led while etcdctl lock held";
  EXPECT_EQ(lock.interrupt(), 0);
  ASSERT_EQ(campaign.wait_for(10s), std::future_status::ready) << "turnstile never led after the lock's release";
  ASSERT_TRUE(campaign.get());
  EXPECT_EQ(client.election(name).leader()->value, "t1");
  election.resign();
}

// A candidate's key deleted by hand: the leader is told at once, and its side key
// (\x1fturnstile/candidates/NAME/<hex>_<n>, on the client's lease) goes too. Before, it stayed
// for as long as the client lived.
TEST_F(EtcdElection, CandidateKeyDeletedByHandTakesItsSideKeyAlong) {
  const auto name = unique_name("elect-del");
  auto client = Client::connect(url_, with_ttl(30s));
  auto election = client.election(name);
  ASSERT_TRUE(election.campaign_for("t1", 5s));
  const auto lost = election.lost_token();
  const auto side_keys = [&] {
    return shell(etcdctl_command(
        url_, "get --prefix --keys-only " + server_tests::quoted("\x1fturnstile/candidates/" + name + "/")));
  };
  ASSERT_NE(side_keys().find(name), std::string::npos) << "no side key: the test shows nothing";
  ASSERT_NE(shell(etcdctl_command(url_, "del " + server_tests::quoted(stored(name).at(0)))).find('1'),
            std::string::npos);
  EXPECT_TRUE(eventually([&] { return lost.stop_requested(); }, 5s)) << "the leader was not told";
  EXPECT_TRUE(eventually([&] { return side_keys().find(name) == std::string::npos; }, 5s)) << side_keys();
}

}  // namespace
