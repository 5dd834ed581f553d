// `turnstile run` and `inspect` against the test fixtures' servers (redis, ZooKeeper, etcd): what
// only a network backend can show — a signal while queued leaves the queue, a holder cut off from
// the server is stopped before anyone else enters, the command inherits no connection, peers'
// data is escaped. One test per family, each with its server fixture.
#include <cstdlib>
#include <map>

#include "cli_support.hpp"
#include "support/tcp_proxy.hpp"

namespace {

using namespace cli_tests;

// "family=@url-file|..." from CMake: each fixture's server URL is in its file once it runs.
std::map<std::string, std::string> server_url_files() {
  std::map<std::string, std::string> files;
  std::string_view spec = TURNSTILE_CLI_SERVERS;
  while (!spec.empty()) {
    const auto bar = spec.find('|');
    const auto item = spec.substr(0, bar);
    if (const auto eq = item.find("=@"); eq != std::string_view::npos) {
      files[std::string(item.substr(0, eq))] = std::string(item.substr(eq + 2));
    }
    spec = bar == std::string_view::npos ? std::string_view{} : spec.substr(bar + 1);
  }
  return files;
}

std::vector<std::string> families() {
  std::vector<std::string> out;
  for (const auto& [family, file] : server_url_files()) out.push_back(family);
  if (out.empty()) out.push_back("none");  // keeps the suite instantiated; its tests skip
  return out;
}

class CliServerTest : public CliTest, public ::testing::WithParamInterface<std::string> {
 protected:
  void SetUp() override {
    CliTest::SetUp();
    const auto files = server_url_files();
    const auto file = files.find(GetParam());
    if (file == files.end()) GTEST_SKIP() << "no server for " << GetParam();
    std::getline(std::ifstream(file->second), url_);
    if (url_.empty()) GTEST_SKIP() << "the " << GetParam() << " server fixture is not running";
    backend_ = url_;
    name_ = "cli/" + std::to_string(getpid()) + "-" + std::to_string(std::rand()) + "/job";
  }

  std::vector<std::string> run_args(const std::string& url, const std::string& ttl,
                                    const std::vector<std::string>& command) {
    std::vector<std::string> args{"run", "--backend", url, "--ttl", ttl, "--lock", name_, "--"};
    args.insert(args.end(), command.begin(), command.end());
    return args;
  }

  std::string url_, name_;
};

// 16.8: no connection of the library (hiredis, ZooKeeper, gRPC sockets, their eventfds) reaches
// the command.
TEST_P(CliServerTest, ChildInheritsOnlyTheStandardDescriptors) {
  const auto listing = path("fds");
  const auto result = run(run_args(url_, "10", {TURNSTILE_PROBE_CHILD_PATH, "fds", listing}));
  ASSERT_EQ(result.status, 0) << result.err;
  EXPECT_EQ(listed_descriptors(listing), (std::vector<int>{0, 1, 2})) << read_file(listing);
}

// 10.4: Ctrl-C while queued leaves the queue at once, instead of leaving an entry that the next
// contender waits behind for a whole TTL.
TEST_P(CliServerTest, SignalWhileQueuedLeavesTheQueue) {
  const auto ready = path("ready"), release = path("release"), ran = path("ran");
  auto holder = start(run_args(url_, "20", {"sh", "-c", "touch " + ready + "; while [ ! -e " + release +
                                                            " ]; do sleep 0.02; done"}));
  ASSERT_TRUE(wait_until([&] { return fs::exists(ready); })) << holder.err();
  auto waiter = start(run_args(url_, "20", {"touch", ran}));
  ASSERT_TRUE(wait_until([&] { return waiter_count_is(name_, 1); })) << waiter.err();
  kill(waiter.pid, SIGINT);
  EXPECT_EQ(wait_exit(waiter), 128 + SIGINT) << waiter.err();
  EXPECT_TRUE(waiter_count_is(name_, 0)) << "the interrupted waiter left its entry in the queue";
  write_file(release, "");
  EXPECT_EQ(wait_exit(holder), 0) << holder.err();
  EXPECT_FALSE(fs::exists(ran));
}

// 10.2b: a holder whose link to the server is cut (black hole: no reset, no answers) has its
// command stopped before a contender on the same server enters, and turnstile exits promptly
// after, without waiting on the dead connection. The command ignores SIGTERM: the default
// --grace (5 s) is longer than the safety margin, so on loss SIGKILL must come within half of
// it (TTL/20 with --ttl 2: 100 ms), and the command must be dead before the contender enters.
TEST_P(CliServerTest, CutOffHolderIsStoppedBeforeTheContenderEnters) {
  // After SIGTERM: SIGKILL within 100 ms, then at most 1 s for reaping and the release; the rest
  // is room for scheduling.
  constexpr auto kExitBound = std::chrono::milliseconds(1600);
  turnstile_test::TcpProxy proxy(url_);
  const auto log = path("beats"), entered = path("entered");
  auto holder = start(run_args(proxy.url_through(url_), "2", {TURNSTILE_PROBE_CHILD_PATH, "beat", log}));
  ASSERT_TRUE(wait_until([&] { return !read_beats(log).beats.empty(); })) << holder.err();
  auto contender = start(run_args(url_, "2", {TURNSTILE_PROBE_CHILD_PATH, "stamp", entered}));
  ASSERT_TRUE(wait_until([&] { return waiter_count_is(name_, 1); })) << contender.err();  // really waiting

  proxy.blackhole();
  int status = 0;
  ASSERT_TRUE(wait_until([&] { return waitpid(holder.pid, &status, WNOHANG) == holder.pid; }, 30s))
      << "the cut-off holder never exited; stderr: " << holder.err();
  const auto exited_ns = turnstile::testing::monotonic_ns();
  std::erase(started_, holder.pid);
  EXPECT_EQ(shell_status(status), 70) << holder.err();
  EXPECT_EQ(wait_exit(contender), 0) << contender.err();

  const auto beats = read_beats(log);
  const auto entered_ns = read_number(entered);
  ASSERT_NE(beats.term, 0u) << "the command was never told to stop; stderr: " << holder.err();
  ASSERT_NE(entered_ns, 0u);
  const auto ms = [](std::uint64_t from, std::uint64_t to) {
    return (static_cast<double>(to) - static_cast<double>(from)) / 1e6;
  };
  std::printf("%s: SIGTERM %.0f ms and the last sign of life %.0f ms before the contender entered; turnstile "
              "exited %.0f ms after the SIGTERM\n",
              GetParam().c_str(), ms(beats.term, entered_ns), ms(beats.last(), entered_ns), ms(beats.term, exited_ns));
  EXPECT_LT(beats.term, entered_ns) << "two holders at once: the contender entered before the command was told";
  EXPECT_LT(beats.last(), entered_ns) << "the command ignoring SIGTERM still ran when the contender entered";
  EXPECT_LT(exited_ns - beats.term, static_cast<std::uint64_t>(std::chrono::nanoseconds(kExitBound).count()))
      << "turnstile lingered after the loss; stderr: " << holder.err();
}

// A signal before the command started means it is not run, even when it comes while turnstile
// is still connecting or trying for the first time (here: the link to the server stalls, the
// signal comes, then the link heals and the uncontended hold is granted): the hold is given
// back, nothing is left on the server, and turnstile exits 128 + signal.
TEST_P(CliServerTest, SignalBeforeTheFirstTryIsAnsweredMeansTheCommandIsNotRun) {
  turnstile_test::TcpProxy proxy(url_);
  proxy.blackhole();
  const auto ran = path("ran");
  Launch blocked;  // a command that got the signal after it started would still run to its end
  blocked.blocked_signal = SIGTERM;
  auto waiter = start(run_args(proxy.url_through(url_), "10", {"touch", ran}), blocked);
  ASSERT_TRUE(wait_until([&] { return proxy.accepted() > 0; })) << waiter.err();  // stalled on the server
  std::this_thread::sleep_for(200ms);
  kill(waiter.pid, SIGTERM);
  proxy.forward();
  EXPECT_EQ(wait_exit(waiter), 128 + SIGTERM) << waiter.err();
  EXPECT_FALSE(fs::exists(ran)) << "the command ran although the signal came before it started";
  const auto inspection = inspect_json(name_);
  EXPECT_TRUE(inspection["holders"].empty() && inspection["waiters"].empty()) << inspection.dump();
  const auto next = run({"run", "--backend", url_, "--timeout", "0", "--lock", name_, "--", "true"});
  EXPECT_EQ(next.status, 0) << "the hold was not given back: " << next.err;
}

// Turnstile itself stopped (SIGSTOP) renews nothing, so its hold runs out on the server: its
// watcher stops the command's group too, so the command does not run while a contender holds;
// once continued, turnstile finds the hold lost and stops the command instead of continuing it.
TEST_P(CliServerTest, StoppedTurnstileStopsItsCommandBeforeTheContenderEnters) {
  const auto log = path("beats"), entered = path("entered");
  auto holder = start(run_args(url_, "2", {TURNSTILE_PROBE_CHILD_PATH, "beat", log}));
  ASSERT_TRUE(wait_until([&] { return !read_beats(log).beats.empty(); })) << holder.err();
  kill(holder.pid, SIGSTOP);
  // Enters once the stopped holder's hold has run out on the server.
  EXPECT_EQ(run(run_args(url_, "2", {TURNSTILE_PROBE_CHILD_PATH, "stamp", entered})).status, 0);
  const auto continued_ns = turnstile::testing::monotonic_ns();
  kill(holder.pid, SIGCONT);
  EXPECT_EQ(wait_exit(holder), 70) << holder.err();
  const auto entered_ns = read_number(entered);
  ASSERT_NE(entered_ns, 0u);
  EXPECT_FALSE(read_beats(log).beat_within(entered_ns, continued_ns))
      << "the command ran while turnstile was stopped and the contender held";
}

// 10.15: a peer's host name with terminal escapes and bytes that are not UTF-8, as stored on the
// server by its holder, is shown escaped by inspect, and --json stays valid.
TEST_P(CliServerTest, InspectEscapesAPeersHostileHostName) {
  const auto ready = path("ready"), release = path("release");
  Launch hostile;
  hostile.prefix = {TURNSTILE_PROBE_CHILD_PATH, "hostname", "p\\e]0;owned\\x07q\\xfe"};
  auto holder = start(run_args(url_, "10", {"sh", "-c", "touch " + ready + "; while [ ! -e " + release +
                                                            " ]; do sleep 0.02; done"}),
                      hostile);
  int status = 0;
  bool exited = false;
  ASSERT_TRUE(wait_until([&] {
    exited = exited || waitpid(holder.pid, &status, WNOHANG) == holder.pid;
    return fs::exists(ready) || exited;
  }));
  if (exited) {
    std::erase(started_, holder.pid);
    if (shell_status(status) == 77) GTEST_SKIP() << "no UTS namespace here: " << holder.err();
    FAIL() << "the holder did not run: " << shell_status(status) << " " << holder.err();
  }
  const auto json = run({"inspect", "--backend", url_, "--json", name_});
  ASSERT_EQ(json.status, 0) << json.err;
  const auto parsed = nlohmann::json::parse(json.out, nullptr, false);
  ASSERT_FALSE(parsed.is_discarded()) << json.out;
  ASSERT_EQ(parsed["holders"].size(), 1u) << json.out;
  const auto host = parsed["holders"][0]["host"].get<std::string>();
  if (host.empty()) {
    write_file(release, "");
    wait_exit(holder);
    GTEST_SKIP() << GetParam() << " does not record the holder's host";
  }
  EXPECT_EQ(host, "p\x1b]0;owned\x07q\xef\xbf\xbd");
  const auto table = run({"inspect", "--backend", url_, name_});
  EXPECT_EQ(table.status, 0) << table.err;
  EXPECT_EQ(table.out.find('\x1b'), std::string::npos) << table.out;
  EXPECT_EQ(table.out.find('\x07'), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("p\\u{1b}]0;owned\\u{7}q\\xfe"), std::string::npos) << table.out;
  write_file(release, "");
  EXPECT_EQ(wait_exit(holder), 0) << holder.err();
}

INSTANTIATE_TEST_SUITE_P(Servers, CliServerTest, ::testing::ValuesIn(families()),
                         [](const auto& info) { return info.param; });

}  // namespace
