// SPDX-License-Identifier: Apache-2.0
// `turnstile run` and `inspect` against the test fixtures' servers (redis, ZooKeeper, etcd): what
// only a network backend can show — a signal while queued leaves the queue, a holder cut off from
// the server is stopped before anyone else enters, the command inherits no connection, peers'
// data is escaped. One test per family, each with its server fixture.
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <map>
#include <optional>
#include <thread>

#include "cli_support.hpp"
#include "support/local_port.hpp"
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

  void expect_a_stalled_keep_keeps_its_promise(std::chrono::milliseconds stall);

  std::vector<std::string> run_args(const std::string& url, const std::string& ttl,
                                    const std::vector<std::string>& command) {
    std::vector<std::string> args{"run", "--backend", url, "--ttl", ttl, "--lock", name_, "--"};
    args.insert(args.end(), command.begin(), command.end());
    return args;
  }

  // `turnstile hold NAME` (TTL 10 s), holding once it printed its token (holder_held_ says
  // whether it did); closing its stdin releases.
  Process hold_name() {
    Launch pipes;
    pipes.stdin_pipe = pipes.stdout_pipe = true;
    auto holder = start({"hold", "--backend", url_, "--ttl", "10", name_}, pipes);
    holder_held_ = !read_line(holder.stdout_fd).empty();
    return holder;
  }

  // See KillNineOfTurnstileReleasesTheHoldAtOnce.
  void expect_freed_after_kill_nine(const std::vector<std::string>& what);

  std::string url_, name_;
  bool holder_held_ = false;
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
  auto holder = start(
      run_args(url_, "20", {"sh", "-c", "touch " + ready + "; while [ ! -e " + release + " ]; do sleep 0.02; done"}));
  ASSERT_TRUE(wait_until([&] { return fs::exists(ready); })) << holder.err();
  auto waiter = start(run_args(url_, "20", {"touch", ran}));
  ASSERT_TRUE(wait_until([&] { return waiter_count_is(name_, 1); })) << waiter.err();
  kill(waiter.pid, SIGINT);
  EXPECT_EQ(wait_exit(waiter), 128 + SIGINT) << waiter.err();
  EXPECT_TRUE(waiter_count_is(name_, 0)) << "the interrupted waiter left its entry in the queue";
  EXPECT_NE(waiter.err().find("left the queue of '" + name_ + "'"), std::string::npos) << waiter.err();
  write_file(release, "");
  EXPECT_EQ(wait_exit(holder), 0) << holder.err();
  EXPECT_FALSE(fs::exists(ran));
}

// Issue 22 item 7: Ctrl-C while queued, with the server no longer answering (its link black-holed
// after the waiter queued): leaving the queue cannot be confirmed, and turnstile must not say it
// left. It said "left the queue of 'NAME'" whatever the leave's outcome.
TEST_P(CliServerTest, SignalWhileQueuedSaysSoWhenLeavingIsNotConfirmed) {
  auto holder = hold_name();
  ASSERT_TRUE(holder_held_) << holder.err();
  turnstile_test::TcpProxy proxy(url_);
  const auto ran = path("ran");
  auto waiter = start(run_args(proxy.url_through(url_), "2", {"touch", ran}));
  ASSERT_TRUE(wait_until([&] { return waiter_count_is(name_, 1); })) << waiter.err();  // really queued
  proxy.blackhole();
  kill(waiter.pid, SIGINT);
  EXPECT_EQ(wait_exit(waiter), 128 + SIGINT) << waiter.err();
  const auto err = waiter.err();
  EXPECT_EQ(err.find("left the queue of"), std::string::npos) << "claimed a leave nobody confirmed: " << err;
  // Its own words, or the signal watcher's when even trying took too long.
  EXPECT_TRUE(err.find("could not confirm leaving the queue of '" + name_ + "'") != std::string::npos ||
              err.find("could not leave the queue of '" + name_ + "' in time") != std::string::npos)
      << err;
  EXPECT_FALSE(fs::exists(ran));
  proxy.forward();
  close_pipe(holder.stdin_fd);
  EXPECT_EQ(wait_exit(holder), 0) << holder.err();
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
  std::printf(
      "%s: SIGTERM %.0f ms and the last sign of life %.0f ms before the contender entered; turnstile "
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
  auto holder = start(
      run_args(url_, "10", {"sh", "-c", "touch " + ready + "; while [ ! -e " + release + " ]; do sleep 0.02; done"}),
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

// --- issue 13: the habits of flock, consul lock and etcdctl lock users, on every server ----------

// `turnstile hold`: the token on stdout once held (the one inspect shows), held until stdin
// closes, then released.
TEST_P(CliServerTest, HoldKeepsTheHoldUntilStdinCloses) {
  Launch pipes;
  pipes.stdin_pipe = pipes.stdout_pipe = true;
  auto holder = start({"hold", "--backend", url_, "--ttl", "10", name_}, pipes);
  const auto token = read_line(holder.stdout_fd);
  ASSERT_FALSE(token.empty()) << holder.err();
  const auto q = inspect_json(name_);
  ASSERT_EQ(q["holders"].size(), 1u) << q.dump();
  EXPECT_EQ(std::to_string(q["holders"][0]["fencing_token"].get<std::uint64_t>()), token) << q.dump();
  EXPECT_EQ(run({"run", "--backend", url_, "--timeout", "0", "--lock", name_, "--", "true"}).status, 75);
  close_pipe(holder.stdin_fd);
  EXPECT_EQ(wait_exit(holder), 0) << holder.err();
  const auto after = run({"run", "--backend", url_, "--timeout", "0", "--lock", name_, "--", "true"});
  EXPECT_EQ(after.status, 0) << "not released: " << after.err;
}

// -v: what it waits for and where, who holds it, when it got it and the token its command sees.
TEST_P(CliServerTest, VerboseNamesWhatItWaitsForTheHolderAndTheToken) {
  auto holder = hold_name();
  ASSERT_TRUE(holder_held_) << holder.err();
  const auto token_file = path("token");
  auto waiter = start({"run", "-v", "--backend", url_, "--ttl", "10", "--lock", name_, "--", "sh", "-c",
                       "echo $TURNSTILE_FENCING_TOKEN > " + token_file});
  // A try's own queue entry (zk://) shows as a waiter before -v speaks: wait for the words too.
  ASSERT_TRUE(wait_until([&] {
    return waiter.err().find("turnstile: waiting for") != std::string::npos && waiter_count_is(name_, 1);
  })) << waiter.err();
  const auto waiting = waiter.err();
  EXPECT_NE(waiting.find("turnstile: waiting for the lock '" + name_ + "' on " + url_.substr(0, url_.find("://") + 3)),
            std::string::npos)
      << waiting;
  EXPECT_NE(waiting.find("; held by "), std::string::npos) << waiting;
  close_pipe(holder.stdin_fd);
  EXPECT_EQ(wait_exit(holder), 0) << holder.err();
  EXPECT_EQ(wait_exit(waiter), 0) << waiter.err();
  const auto err = waiter.err();
  EXPECT_NE(err.find("turnstile: got the lock '" + name_ + "' on "), std::string::npos) << err;
  EXPECT_NE(err.find("; fencing token " + std::to_string(read_number(token_file)) + "\n"), std::string::npos) << err;
  EXPECT_NE(err.find("turnstile: released the lock '" + name_ + "'"), std::string::npos) << err;
}

// --holder-label (consul lock -name) is kept with the hold: inspect shows it, and a contender's
// busy message names the holder by it.
TEST_P(CliServerTest, HolderLabelIsShownByInspectAndInTheBusyMessage) {
  Launch pipes;
  pipes.stdin_pipe = pipes.stdout_pipe = true;
  auto holder = start({"hold", "--backend", url_, "--ttl", "10", "--holder-label", "nightly report", name_}, pipes);
  ASSERT_FALSE(read_line(holder.stdout_fd).empty()) << holder.err();
  const auto q = inspect_json(name_);
  ASSERT_EQ(q["holders"].size(), 1u) << q.dump();
  EXPECT_EQ(q["holders"][0]["label"], "nightly report") << q.dump();
  const auto table = run({"inspect", "--backend", url_, name_});
  EXPECT_NE(table.out.find("\"nightly report\""), std::string::npos) << table.out;
  const auto busy = run({"run", "--backend", url_, "--timeout", "0", "--lock", name_, "--", "true"});
  EXPECT_EQ(busy.status, 75) << busy.err;
  EXPECT_NE(busy.err.find("is busy; held by \"nightly report\" pid "), std::string::npos) << busy.err;
  close_pipe(holder.stdin_fd);
  EXPECT_EQ(wait_exit(holder), 0) << holder.err();
}

// --timeout bounds the whole wait, connecting included: a server that accepts connections and
// never answers (a black hole), or a port nobody listens on, ends a `--timeout 1` run well
// before its `--connect-timeout` of 600 s would. --connect-timeout alone bounds connecting for
// run, hold and inspect.
TEST_P(CliServerTest, TimeoutBoundsConnecting) {
  turnstile_test::TcpProxy proxy(url_);
  proxy.blackhole();
  const auto through = proxy.url_through(url_);
  const auto ran = path("ran");
  // Each run is bounded by 1 s; left to themselves the backends' first connection waits 5 s
  // (redis, etcd) to 15 s (ZooKeeper), so 4 s tells the bound from those with a wide margin.
  const auto within_bound = [](auto&& invoke) {
    const auto started = std::chrono::steady_clock::now();
    auto result = invoke();
    return std::pair{std::move(result), std::chrono::steady_clock::now() - started < std::chrono::seconds(4)};
  };
  const auto [timed, timed_in_time] = within_bound([&] {
    return run({"run", "--backend", through, "--timeout", "1", "--connect-timeout", "600", "--lock", name_, "--",
                "touch", ran});
  });
  EXPECT_TRUE(timed.status == 69 || timed.status == 75) << timed.status << " " << timed.err;
  EXPECT_TRUE(timed_in_time) << "--timeout 1 did not bound connecting: " << timed.err;
  const auto [once, once_in_time] = within_bound([&] {
    return run({"hold", "--backend", through, "--timeout", "0", "--connect-timeout", "1", name_});
  });
  EXPECT_TRUE(once.status == 69 || once.status == 75) << once.status << " " << once.err;
  EXPECT_TRUE(once_in_time) << "--connect-timeout 1 did not bound connecting: " << once.err;
  EXPECT_EQ(once.out, "");
  const auto [inspect, inspect_in_time] = within_bound([&] {
    return run({"inspect", "--backend", through, "--connect-timeout", "1", name_});
  });
  EXPECT_EQ(inspect.status, 69) << inspect.out << inspect.err;
  EXPECT_TRUE(inspect_in_time) << "--connect-timeout 1 did not bound inspect's connecting: " << inspect.err;
  // --timeout 0 (flock -n) without --connect-timeout: connecting gets 1 s, not the default 10 s.
  const auto [tried, tried_in_time] = within_bound([&] {
    return run({"run", "--backend", through, "--timeout", "0", "--lock", name_, "--", "touch", ran});
  });
  EXPECT_TRUE(tried.status == 69 || tried.status == 75) << tried.status << " " << tried.err;
  EXPECT_TRUE(tried_in_time) << "--timeout 0 waited the whole connect timeout: " << tried.err;
  const auto nobody = url_.substr(0, url_.find("://") + 3) + "127.0.0.1:1";
  const auto [refused, refused_in_time] = within_bound([&] {
    return run({"run", "--backend", nobody, "--timeout", "1", "--connect-timeout", "600", "--lock", name_, "--",
                "touch", ran});
  });
  EXPECT_TRUE(refused.status == 69 || refused.status == 75) << refused.status << " " << refused.err;
  EXPECT_TRUE(refused_in_time) << "--timeout 1 did not bound connecting to " << nobody << ": " << refused.err;
  EXPECT_FALSE(fs::exists(ran));
}

// Issue 24 item 7: `--connect-timeout 0.001` against a live etcd said "no etcd ... answered";
// what happened is that the connect timed out, and the message says so. redis said "no answer
// in time" (issue 28's leftovers): the server answered, the 1 ms ran out.
TEST_P(CliServerTest, ConnectTimeoutSaysTheConnectTimedOut) {
  if (GetParam() != "etcd" && GetParam() != "redis") GTEST_SKIP() << "the etcd and redis messages only";
  // A server that accepts connections and never says a word: the connect runs out of its
  // timeout whatever the machine's speed (a live server given 1 ms answered in time 16 runs in
  // 40 on a busy machine, and the command ran).
  const turnstile_test::LocalPort silent(true);
  const auto url = GetParam() + "://" + silent.address();
  const auto result = run({"run", "--backend", url, "--connect-timeout", "0.3", "--lock", name_, "--", "true"});
  EXPECT_EQ(result.status, 69) << result.err;
  EXPECT_NE(result.err.find("timed out"), std::string::npos) << result.err;
  EXPECT_EQ(result.err.find("answer"), std::string::npos) << result.err;
}

// Red team (issue 24): with a refusing endpoint listed before a live one, every run spent ~2 s
// on the refusing one, and `--timeout 1.5` failed with 69 though the second endpoint answered.
// zk:// and redis+cluster:// pass over a refusal at once; so does etcd:// now.
TEST_P(CliServerTest, ARefusingFirstEndpointIsPassedOver) {
  if (GetParam() != "etcd") GTEST_SKIP() << "etcd's endpoint list only";
  turnstile_test::LocalPort refusing(false);
  const auto hosts = url_.substr(url_.find("://") + 3);
  const auto url = "etcd://" + refusing.address() + "," + hosts;
  const auto ran = path("ran");
  const auto result = run({"run", "--backend", url, "--timeout", "1.5", "--lock", name_, "--", "touch", ran});
  EXPECT_EQ(result.status, 0) << result.err;
  EXPECT_TRUE(fs::exists(ran));
}

// Red team (issue 13): --timeout bounds the wait when the server stalls mid-wait too. The look
// that names the holder in the timeout message had no deadline: the message came after 8 s
// (redis) to 34 s (ZooKeeper) for `--timeout 2`. Now: the wait, one bounded leave, a 0.5 s look.
TEST_P(CliServerTest, TimeoutBoundsTheRunWhenTheServerStallsMidWait) {
  auto holder = hold_name();
  ASSERT_TRUE(holder_held_) << holder.err();
  turnstile_test::TcpProxy proxy(url_);
  const auto ran = path("ran");
  const auto started = std::chrono::steady_clock::now();
  auto waiter = start({"run", "--backend", proxy.url_through(url_), "--timeout", "1", "--ttl", "10", "--lock", name_,
                       "--", "touch", ran});
  ASSERT_TRUE(wait_until([&] { return waiter_count_is(name_, 1); })) << waiter.err();
  proxy.blackhole();
  // The bound is on the wait, told by the timeout message; closing the client afterwards is
  // not waiting (a ZooKeeper client's close waits a while for the server's answer).
  // 20 s, under CTest's 60: should another message come instead, the test says what it was.
  EXPECT_TRUE(wait_until([&] { return waiter.err().find("timed out after 1 s") != std::string::npos; }, 20s))
      << waiter.err();
  const auto took = std::chrono::steady_clock::now() - started;
  const int status = wait_exit(waiter);
  EXPECT_EQ(status, 75) << waiter.err();
  // 1 s of wait, at most 2 s of leaving (ZooKeeper), 0.5 s of look, and room for a slow machine
  // (the unbounded look took 7 s on redis, the quickest, before).
  EXPECT_LT(took, std::chrono::seconds(6)) << waiter.err();
  EXPECT_FALSE(fs::exists(ran));
  proxy.forward();
  close_pipe(holder.stdin_fd);
  EXPECT_EQ(wait_exit(holder), 0) << holder.err();
}

// inspect names the backend it read, redacted as the library shows it.
TEST_P(CliServerTest, InspectNamesTheBackendItRead) {
  const auto table = run({"inspect", "--backend", url_, name_});
  ASSERT_EQ(table.status, 0) << table.err;
  ASSERT_TRUE(table.out.starts_with("backend  ")) << table.out;
  const auto shown = table.out.substr(9, table.out.find('\n') - 9);
  EXPECT_TRUE(shown.starts_with(url_.substr(0, url_.find("://") + 3))) << shown;
  // A password or token in the URL never shows.
  if (const auto at = url_.find('@'); at != std::string::npos) {
    const auto secret = url_.substr(url_.find("://") + 3, at - url_.find("://") - 3);
    EXPECT_EQ(table.out.find(secret), std::string::npos) << table.out;
  }
  const auto q = inspect_json(name_);
  EXPECT_EQ(q["schema_version"], 1);
  EXPECT_EQ(q["backend"], shown);
}

// inspect --watch --json: a new line when a holder comes and when it goes; SIGINT ends it.
TEST_P(CliServerTest, InspectWatchShowsEachChange) {
  auto watcher = start({"inspect", "--backend", url_, "--watch", "--json", "--interval", "0.1", name_});
  const auto last = [&] {
    std::istringstream in(watcher.out());
    nlohmann::json latest;
    for (std::string line; std::getline(in, line);) {
      if (auto parsed = nlohmann::json::parse(line, nullptr, false); !parsed.is_discarded()) latest = parsed;
    }
    return latest;
  };
  ASSERT_TRUE(wait_until([&] { return last().contains("holders"); })) << watcher.err();
  EXPECT_TRUE(last()["holders"].empty());
  Launch pipes;
  pipes.stdin_pipe = pipes.stdout_pipe = true;
  auto holder = start({"hold", "--backend", url_, "--ttl", "10", name_}, pipes);
  const auto token = read_line(holder.stdout_fd);
  ASSERT_FALSE(token.empty()) << holder.err();
  EXPECT_TRUE(wait_until([&] {
    const auto q = last();
    return q["holders"].size() == 1 && std::to_string(q["holders"][0]["fencing_token"].get<std::uint64_t>()) == token;
  })) << watcher.out();
  close_pipe(holder.stdin_fd);
  EXPECT_EQ(wait_exit(holder), 0) << holder.err();
  EXPECT_TRUE(wait_until([&] { return last()["holders"].empty(); })) << watcher.out();
  kill(watcher.pid, SIGINT);
  EXPECT_EQ(wait_exit(watcher), 0) << watcher.err();
}

// Output of a shell command (stderr included).
std::string shell_output(const std::string& command) {
  std::string output;
  if (FILE* pipe = popen((command + " 2>&1").c_str(), "r")) {
    char buffer[4096];
    while (std::fgets(buffer, sizeof buffer, pipe)) output += buffer;
    pclose(pipe);
  }
  return output;
}

// host:port of a server URL (scheme://[userinfo@]host:port[/...][?...]).
std::string host_port(const std::string& url) {
  auto rest = url.substr(url.find("://") + 3);
  if (const auto at = rest.find('@'); at != std::string::npos) rest = rest.substr(at + 1);
  return rest.substr(0, rest.find_first_of("/?"));
}

// A holder that is not turnstile's (an `etcdctl lock`, a Consul api.Lock session) is shown as
// foreign by inspect — no made-up 1970 start time or pid 0 — and named by the busy message.
TEST_P(CliServerTest, InspectShowsAForeignHolderAsSuch) {
  std::function<void()> let_go;
  std::optional<Process> peer;
  if (GetParam() == "etcd") {
    if (!url_.starts_with("etcd://") || url_.find('@') != std::string::npos) GTEST_SKIP() << "etcdctl needs plain http";
    const auto ready = path("peer-ready"), release = path("peer-release");
    Launch etcdctl;
    etcdctl.env = {{"ETCDCTL_API", "3"}};
    peer = spawn({"etcdctl", "--endpoints=http://" + host_port(url_), "lock", name_, "--", "sh", "-c",
                  "touch " + ready + "; while [ ! -e " + release + " ]; do sleep 0.02; done"},
                 etcdctl);
    ASSERT_TRUE(wait_until([&] { return fs::exists(ready); })) << peer->err();
    let_go = [&, release] {
      write_file(release, "");
      EXPECT_EQ(wait_exit(*peer), 0) << peer->err();
    };
  } else if (GetParam() == "consul") {
    // api.Lock's own requests, as tests/consul makes them: a session, then the key acquired
    // with api.Lock's flags.
    const auto base = "http://" + host_port(url_);
    const auto reply = shell_output(
        "curl -s -X PUT --data-binary '{\"Name\":\"Consul API Lock\",\"TTL\":\"15s\","
        "\"LockDelay\":\"0s\"}' " +
        base + "/v1/session/create");
    const auto id_at = reply.find("\"ID\"");
    ASSERT_NE(id_at, std::string::npos) << reply;
    const auto quote = reply.find('"', reply.find(':', id_at) + 1);
    const auto session = reply.substr(quote + 1, 36);
    const std::string flags = "3304740253564472344";
    ASSERT_EQ(
        shell_output("curl -s -X PUT '" + base + "/v1/kv/" + name_ + "?acquire=" + session + "&flags=" + flags + "'"),
        "true");
    let_go = [base, session, flags, this] {
      shell_output("curl -s -X PUT '" + base + "/v1/kv/" + name_ + "?release=" + session + "&flags=" + flags + "'");
      shell_output("curl -s -X PUT " + base + "/v1/session/destroy/" + session);
    };
  } else {
    GTEST_SKIP() << GetParam() << ": no foreign client here (redis: turnstile's Mutex is not Redisson's layout; "
                 << "zookeeper: the Curator peer is tests/zookeeper's)";
  }
  const auto q = inspect_json(name_);
  ASSERT_EQ(q["holders"].size(), 1u) << q.dump();
  const auto& h = q["holders"][0];
  EXPECT_TRUE(h["foreign"].is_string() && !h["foreign"].get<std::string>().empty()) << q.dump();
  EXPECT_TRUE(h["pid"].is_null() && h["host"].is_null() && h["since"].is_null()) << q.dump();
  const auto table = run({"inspect", "--backend", url_, name_});
  EXPECT_NE(table.out.find("foreign: "), std::string::npos) << table.out;
  EXPECT_EQ(table.out.find("1970-01-01"), std::string::npos) << table.out;
  const auto busy = run({"run", "--backend", url_, "--timeout", "0", "--lock", name_, "--", "true"});
  EXPECT_EQ(busy.status, 75) << busy.err;
  if (h["foreign"].is_string()) {
    EXPECT_NE(busy.err.find("held by " + h["foreign"].get<std::string>()), std::string::npos) << busy.err;
  }
  let_go();
}

// Issue 24 item 9: inspect without NAME lists the names in use under a prefix with their holder
// and waiter counts, on every backend (the CLI refused a missing NAME); a released name leaves
// the list.
TEST_P(CliServerTest, InspectListsTheNamesInUse) {
  const auto base = name_.substr(0, name_.rfind('/') + 1);  // "cli/<pid>-<n>/", this test's own
  const auto list = [&](std::vector<std::string> extra) {
    std::vector<std::string> args{"inspect", "--backend", url_, "--json", "--prefix", base};
    args.insert(args.end(), extra.begin(), extra.end());
    const auto result = run(args);
    EXPECT_EQ(result.status, 0) << result.err;
    return nlohmann::json::parse(result.out, nullptr, false);
  };
  auto holder = hold_name();
  ASSERT_TRUE(holder_held_) << holder.err();
  auto waiter = start(run_args(url_, "10", {"true"}));
  ASSERT_TRUE(wait_until([&] { return waiter_count_is(name_, 1); })) << waiter.err();  // really queued
  const auto ready = path("ready"), release = path("release");
  auto pool = start({"run", "--backend", url_, "--ttl", "10", "--semaphore", base + "pool", "--limit", "2", "--", "sh",
                     "-c", "touch " + ready + "; while [ ! -e " + release + " ]; do sleep 0.02; done"});
  ASSERT_TRUE(wait_until([&] { return fs::exists(ready); })) << pool.err();
  // A name under another, whose last segment is one of a name's own nodes on zk:// ("locks").
  const auto nested_ready = path("nested-ready");
  auto nested = start({"run", "--backend", url_, "--ttl", "10", "--lock", name_ + "/locks", "--", "sh", "-c",
                       "touch " + nested_ready + "; while [ ! -e " + release + " ]; do sleep 0.02; done"});
  ASSERT_TRUE(wait_until([&] { return fs::exists(nested_ready); })) << nested.err();

  const auto all = list({});
  ASSERT_EQ(all["names"].size(), 3u) << all.dump();
  EXPECT_EQ(all["names"][0],
            nlohmann::json::parse(R"({"name":")" + name_ + R"(","mode":"lock","limit":null,"holders":1,"waiters":1})"));
  EXPECT_EQ(all["names"][1], nlohmann::json::parse(R"({"name":")" + name_ +
                                                   R"(/locks","mode":"lock","limit":null,"holders":1,"waiters":0})"));
  EXPECT_EQ(all["names"][2], nlohmann::json::parse(R"({"name":")" + base +
                                                   R"(pool","mode":"semaphore","limit":2,"holders":1,"waiters":0})"));
  EXPECT_FALSE(all["truncated"].get<bool>());
  const auto first = list({"--max-names", "1"});
  ASSERT_EQ(first["names"].size(), 1u) << first.dump();
  EXPECT_TRUE(first["truncated"].get<bool>());
  const auto table = run({"inspect", "--backend", url_, "--prefix", base});
  EXPECT_NE(table.out.find("HOLDERS"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find(base + "pool"), std::string::npos) << table.out;

  close_pipe(holder.stdin_fd);
  write_file(release, "");
  EXPECT_EQ(wait_exit(holder), 0) << holder.err();
  EXPECT_EQ(wait_exit(waiter), 0) << waiter.err();
  EXPECT_EQ(wait_exit(pool), 0) << pool.err();
  EXPECT_EQ(wait_exit(nested), 0) << nested.err();
  EXPECT_TRUE(wait_until([&] { return list({})["names"].empty(); })) << list({}).dump();
}

// Issue 24 item 3: after kill -9 of `turnstile run`, its watcher kills the command's group and
// then releases the hold on the server, so the next holder enters at once instead of after the
// TTL (30 s here; it waited 29.5 s on zk, 30 s on redis, 44 s on consul). The bound asserted is
// generous (the goal is < 1 s); the time taken is printed. `what` is the hold's options.
void CliServerTest::expect_freed_after_kill_nine(const std::vector<std::string>& what) {
  const auto ready = path("ready"), pid_file = path("pid");
  const auto run_with = [&](std::vector<std::string> first, const std::vector<std::string>& command) {
    first.insert(first.end(), what.begin(), what.end());
    first.push_back("--");
    first.insert(first.end(), command.begin(), command.end());
    return first;
  };
  // One process in the command's group (exec), an orphan of ours once turnstile dies (we are the
  // subreaper, as init is for a real turnstile). We reap it only after the next holder got in,
  // as an init that reaps late would (seconds on some VMs, never in a container whose PID 1 does
  // not reap): the release waits for the group to be dead, not reaped.
  auto holder = start(run_with({"run", "--backend", url_, "--ttl", "30"},
                               {"sh", "-c", "echo $$ > " + pid_file + "; touch " + ready + "; exec sleep 100"}));
  ASSERT_TRUE(wait_until([&] { return fs::exists(ready); })) << holder.err();
  const auto command = static_cast<pid_t>(read_number(pid_file));
  ASSERT_GT(command, 0);
  // Really held: a try fails while turnstile lives.
  const auto busy = run(run_with({"run", "--backend", url_, "--timeout", "0"}, {"true"}));
  ASSERT_EQ(busy.status, 75) << busy.err;
  kill(holder.pid, SIGKILL);
  const auto killed_at = std::chrono::steady_clock::now();
  EXPECT_EQ(wait_exit(holder), 128 + SIGKILL);
  EXPECT_TRUE(wait_until([&] { return zombie(command); })) << "the command outlived turnstile";
  const auto next = run(run_with({"run", "--backend", url_, "--timeout", "5"}, {"true"}));
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - killed_at;
  EXPECT_TRUE(gone(command));  // reaped only now
  EXPECT_EQ(next.status, 0) << next.err;
  EXPECT_LT(took.count(), 5.0) << "the next holder waited for the TTL";
  std::printf("[ %s %s ] the next holder entered %.3f s after kill -9\n", GetParam().c_str(), what.front().c_str(),
              took.count());
}

// Red team (issue 24, F1): turnstile killed while its release waited for the server (kill -9 as
// the command ended was enough on etcd, whose server drops a call whose client went) left the
// entry to the TTL: the watcher was dismissed before the release. It now stays until the release
// is confirmed, and releases by the receipt after turnstile's death. Here the link holds the
// release back (the proxy delivers it once turnstile is dead: a late copy, which etcd drops).
TEST_P(CliServerTest, KillNineDuringTheReleaseStillFreesTheNameAtOnce) {
  turnstile_test::TcpProxy proxy(url_);
  const auto ready = path("ready"), go = path("go"), pid_file = path("pid");
  auto holder =
      start({"run", "--backend", proxy.url_through(url_), "--ttl", "30", "--lock", name_, "--", "sh", "-c",
             "echo $$ > " + pid_file + "; touch " + ready + "; while [ ! -e " + go + " ]; do sleep 0.02; done"});
  ASSERT_TRUE(wait_until([&] { return fs::exists(ready); })) << holder.err();
  const auto command = static_cast<pid_t>(read_number(pid_file));
  ASSERT_GT(command, 0);
  proxy.blackhole();
  write_file(go, "");
  ASSERT_TRUE(wait_until([&] { return gone(command); })) << "the command never ended";
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // turnstile is in its release
  kill(holder.pid, SIGKILL);
  EXPECT_EQ(wait_exit(holder), 128 + SIGKILL);
  proxy.forward();
  const auto next = run({"run", "--backend", url_, "--timeout", "10", "--lock", name_, "--", "true"});
  EXPECT_EQ(next.status, 0) << "the next holder waited for the TTL (30 s): " << next.err;
}

TEST_P(CliServerTest, KillNineOfTurnstileReleasesTheHoldAtOnce) { expect_freed_after_kill_nine({"--lock", name_}); }

TEST_P(CliServerTest, KillNineOfTurnstileReleasesTheLeaseAtOnce) {
  expect_freed_after_kill_nine({"--semaphore", name_, "--limit", "1"});
}

// Issue 24 item 4: the entry's own expiry on the server keeps the name held after turnstile exits.
// Where the backend cannot keep a hold yet, turnstile says so before it takes the hold or runs
// anything.
TEST_P(CliServerTest, HoldAtLeastRunsTheJobOnceAcrossHosts) {
  if (GetParam() != "zookeeper") expect_hold_at_least_runs_the_job_once(name_);
  if (GetParam() != "zookeeper" && GetParam() != "consul") return;
  const auto ran = path("ran");
  // ZooKeeper keeps nothing yet; Consul keeps locks, not a Semaphore's leases.
  const std::vector<std::string> refused_args =
      GetParam() == "consul" ? std::vector<std::string>{"run",
                                                        "--backend",
                                                        url_,
                                                        "--semaphore",
                                                        name_ + "-pool",
                                                        "--limit",
                                                        "2",
                                                        "--timeout",
                                                        "30",
                                                        "--hold-at-least",
                                                        "5s",
                                                        "--",
                                                        "touch",
                                                        ran}
                             : lock_sh(name_, "touch " + ran, {"--timeout", "30", "--hold-at-least", "5s"});
  const auto refused = run(refused_args);
  EXPECT_EQ(refused.status, 64) << refused.err;
  EXPECT_NE(refused.err.find("--hold-at-least is not available on"), std::string::npos) << refused.err;
  EXPECT_FALSE(fs::exists(ran));
}

// Issue 24: `consul://` names no agent; -v says which one CONSUL_HTTP_ADDR pointed it at.
TEST_P(CliServerTest, VerboseNamesTheConsulAgentTheEnvironmentChose) {
  if (GetParam() != "consul") GTEST_SKIP() << "only consul:// takes its agent from the environment";
  const auto scheme_end = url_.find("://");
  auto address = url_.substr(scheme_end + 3, url_.find_first_of("/?", scheme_end + 3) - scheme_end - 3);
  std::optional<std::string> token;  // consul://TOKEN@host:port with an ACL token
  if (const auto at = address.rfind('@'); at != std::string::npos) {
    token = address.substr(0, at);
    address = address.substr(at + 1);
  }
  Launch consul_env;
  consul_env.env = {{"CONSUL_HTTP_ADDR", "http://" + address}, {"CONSUL_HTTP_TOKEN", token}};
  const auto result = run({"run", "-v", "--backend", "consul://", "--lock", name_, "--", "true"}, consul_env);
  EXPECT_EQ(result.status, 0) << result.err;
  EXPECT_NE(result.err.find("on consul:// (the agent at http://" + address + ", from CONSUL_HTTP_ADDR) at "),
            std::string::npos)
      << result.err;
}

// Issue 24: against a server that stopped answering, the release at exit was told as "retried
// in the background", then at once "gave up removing it": one message now says what happens.
TEST_P(CliServerTest, AReleaseTheServerDidNotConfirmIsToldOnce) {
  turnstile_test::TcpProxy proxy(url_);
  const auto ready = path("ready"), go = path("go");
  auto holder = start(run_args(proxy.url_through(url_), "10",
                               {"sh", "-c", "touch " + ready + "; while [ ! -e " + go + " ]; do sleep 0.02; done"}));
  ASSERT_TRUE(wait_until([&] { return fs::exists(ready); })) << holder.err();
  proxy.hold_replies();  // as a SIGSTOPped server: requests arrive, no answer comes
  write_file(go, "");
  const int status = wait_exit(holder);
  proxy.forward();
  const auto err = holder.err();
  if (err.find("was not confirmed") == std::string::npos) {
    // Some clients finish a release without an answer (it is then not this message's case).
    EXPECT_EQ(err.find("retried in the background"), std::string::npos) << err;
    GTEST_SKIP() << GetParam() << ": the release did not wait for the server; status " << status << ", " << err;
  }
  EXPECT_EQ(status, 0) << err;  // the command ran and exited 0 under the hold
  EXPECT_EQ(err.find("retried in the background"), std::string::npos) << err;
  EXPECT_EQ(err.find("gave up"), std::string::npos) << err;
}

// Issue 24 item 4 (red team F2): the keep of --hold-at-least sent while the server answers
// nothing for `stall` (its requests wait, as with a SIGSTOPped server, and arrive late). The
// name stays held until the promised end, and (consul:// aside: its 10 s session minimum) not
// from the keep's late arrival on; nothing says "released plainly", and the own keep is no loss
// (etcd said "overwritten by another writer", exit 70).
void CliServerTest::expect_a_stalled_keep_keeps_its_promise(std::chrono::milliseconds stall) {
  if (GetParam() == "zookeeper") GTEST_SKIP() << "zk:// keeps nothing (--hold-at-least is refused)";
  turnstile_test::TcpProxy proxy(url_);
  const auto ready = path("ready"), go = path("go");
  const auto started = std::chrono::steady_clock::now();  // before the hold: the promise ends later
  auto holder = start({"run", "--backend", proxy.url_through(url_), "--ttl", "10", "--hold-at-least", "6s", "--lock",
                       name_, "--", "sh", "-c", "touch " + ready + "; while [ ! -e " + go + " ]; do sleep 0.02; done"});
  ASSERT_TRUE(wait_until([&] { return fs::exists(ready); })) << holder.err();
  proxy.blackhole();
  write_file(go, "");
  std::this_thread::sleep_for(stall);
  proxy.forward();
  const int status = wait_exit(holder);
  const auto err = holder.err();
  EXPECT_EQ(status, 0) << err;  // the command's
  EXPECT_EQ(err.find("released plainly"), std::string::npos) << err;
  EXPECT_EQ(err.find("overwritten"), std::string::npos) << err;
  if (std::chrono::steady_clock::now() < started + std::chrono::milliseconds(5500)) {
    const auto busy = run({"run", "--backend", url_, "--timeout", "0", "--lock", name_, "--", "true"});
    EXPECT_EQ(busy.status, 75) << "freed before the promised end: " << busy.err;
  }
  if (GetParam() == "consul") return;  // kept at least 10 s, up to twice that (see below)
  const auto waited = run({"run", "--backend", url_, "--timeout", "30", "--lock", name_, "--", "true"});
  const std::chrono::duration<double> free_at = std::chrono::steady_clock::now() - started;
  EXPECT_EQ(waited.status, 0) << waited.err;
  EXPECT_GE(free_at.count(), 6.0);
  EXPECT_LT(free_at.count(), 9.0) << "kept from the keep's late arrival on";  // etcd: whole seconds
  std::printf("[ %s ] free %.3f s after the start (6 s promised, %lld ms stall)\n", GetParam().c_str(), free_at.count(),
              static_cast<long long>(stall.count()));
}

TEST_P(CliServerTest, HoldAtLeastKeepsItsPromiseThroughAShortStall) {
  expect_a_stalled_keep_keeps_its_promise(std::chrono::milliseconds(2500));
}

TEST_P(CliServerTest, HoldAtLeastKeepsItsPromiseThroughALongStall) {
  expect_a_stalled_keep_keeps_its_promise(std::chrono::milliseconds(4500));
}

// Issue 24 item 4 (red team F7): Consul raises a session TTL below its minimum (10 s by default;
// this fixture's session_ttl_min is 1 s), so a kept lock ends no sooner than that after its
// keep: inspect must not show an earlier end (it showed the 300 ms asked for).
TEST_P(CliServerTest, HoldAtLeastShowsConsulsEarliestEnd) {
  if (GetParam() != "consul") GTEST_SKIP() << "only consul:// raises a kept entry's time";
  const auto kept = run({"run", "--backend", url_, "--hold-at-least", "300ms", "--lock", name_, "--", "true"});
  ASSERT_EQ(kept.status, 0) << kept.err;
  const auto json = inspect_json(name_);
  ASSERT_EQ(json["holders"].size(), 1u) << json.dump();
  const auto ms_of = [](const std::string& iso) {  // "YYYY-MM-DDTHH:MM:SS.mmmZ"
    std::tm parts{};
    int ms = 0;
    std::sscanf(iso.c_str(), "%d-%d-%dT%d:%d:%d.%dZ", &parts.tm_year, &parts.tm_mon, &parts.tm_mday, &parts.tm_hour,
                &parts.tm_min, &parts.tm_sec, &ms);
    parts.tm_year -= 1900;
    parts.tm_mon -= 1;
    return static_cast<long long>(timegm(&parts)) * 1000 + ms;
  };
  const auto shown_left = ms_of(json["holders"][0]["kept_until"].get<std::string>()) - ms_of(json["time"]);
  EXPECT_GE(shown_left, 700) << json.dump();  // the 1 s session, less the time to inspect
}

// `turnstile elect NAME -- CMD` runs CMD while leader, with its value and token in CMD's
// environment; `turnstile leader NAME` prints that value (JSON: token too), and nothing with
// exit 1 once the leader resigned (CMD ended by the signal turnstile forwarded). Backends without
// an election layout refuse with 64, naming the backend.
TEST_P(CliServerTest, ElectRunsTheCommandWhileLeaderAndLeaderPrintsItsValue) {
  const auto seen = path("seen");
  auto elected = start({"elect", "--backend", url_, "--ttl", "10", "--value", "alpha", name_, "--", "sh", "-c",
                        "echo \"$TURNSTILE_LEADER_VALUE $TURNSTILE_FENCING_TOKEN\" > " + seen + "; exec sleep 30"});
  ASSERT_TRUE(wait_until([&] { return !read_file(seen).empty() || zombie(elected.pid); })) << elected.err();
  if (elected.err().find("leader election is not available") != std::string::npos) {
    EXPECT_EQ(wait_exit(elected), 64);
    GTEST_SKIP() << GetParam() << " has no election layout yet (refused, 64)";
  }
  const auto line = read_file(seen);
  ASSERT_EQ(line.rfind("alpha ", 0), 0u) << line;
  const auto token = std::stoull(line.substr(6));
  const auto text = run({"leader", "--backend", url_, name_});
  EXPECT_EQ(text.status, 0) << text.err;
  EXPECT_EQ(text.out, "alpha\n");
  const auto json = nlohmann::json::parse(run({"leader", "--backend", url_, "--json", name_}).out);
  EXPECT_EQ(json["leader"], true) << json.dump();
  EXPECT_EQ(json["value"], "alpha") << json.dump();
  EXPECT_EQ(json["fencing_token"].get<std::uint64_t>(), token) << json.dump();
  const auto q = inspect_json(name_);
  EXPECT_EQ(q["mode"], "election") << q.dump();
  ASSERT_EQ(q["holders"].size(), 1u) << q.dump();
  EXPECT_EQ(q["holders"][0]["value"], "alpha") << q.dump();
  const auto busy = run({"elect", "--backend", url_, "--timeout", "0", name_, "--", "true"});
  EXPECT_EQ(busy.status, 75) << busy.err;
  EXPECT_EQ(run({"run", "--backend", url_, "--timeout", "0", "--lock", name_, "--", "true"}).status, 64)
      << "a lock on an election's name must be a kind mismatch";
  kill(elected.pid, SIGTERM);
  EXPECT_EQ(wait_exit(elected), 128 + SIGTERM) << elected.err();
  const auto none = run({"leader", "--backend", url_, name_});
  EXPECT_EQ(none.status, 1) << none.err;
  EXPECT_EQ(none.out, "");
}

// kill -9 of a leading `turnstile elect`: its watcher stops the command and removes the entry
// by its receipt, so the next candidate leads at once, not after the 30 s TTL.
TEST_P(CliServerTest, KillNineOfALeaderLetsTheNextCandidateLeadAtOnce) {
  const auto ready = path("ready");
  auto leader = start({"elect", "--backend", url_, "--ttl", "30", "--value", "doomed", name_, "--", "sh", "-c",
                       "touch " + ready + "; exec sleep 100"});
  ASSERT_TRUE(wait_until([&] { return fs::exists(ready) || zombie(leader.pid); })) << leader.err();
  if (!fs::exists(ready)) GTEST_SKIP() << GetParam() << " has no election layout yet: " << leader.err();
  EXPECT_EQ(run({"leader", "--backend", url_, name_}).out, "doomed\n");
  kill(leader.pid, SIGKILL);
  EXPECT_EQ(wait_exit(leader), 128 + SIGKILL);
  // Within 10 s, a third of the TTL: only the watcher's removal can let it lead (else 75).
  const auto next = run({"elect", "--backend", url_, "--timeout", "10", "--value", "next", name_, "--", "true"});
  EXPECT_EQ(next.status, 0) << next.err;
}

// `turnstile leader --watch` prints the leader now, then each change (etcdctl elect -l).
TEST_P(CliServerTest, LeaderWatchPrintsEachLeader) {
  Launch pipes;
  pipes.stdout_pipe = true;
  auto watcher = start({"leader", "--backend", url_, "--watch", name_}, pipes);
  const auto first = read_line(watcher.stdout_fd);
  if (first.empty() && watcher.err().find("leader election is not available") != std::string::npos) {
    GTEST_SKIP() << GetParam() << " has no election layout yet";
  }
  EXPECT_EQ(first, "(no leader)") << watcher.err();
  const auto elected = run({"elect", "--backend", url_, "--value", "one", name_, "--", "sleep", "0.2"});
  EXPECT_EQ(elected.status, 0) << elected.err;
  EXPECT_EQ(read_line(watcher.stdout_fd), "one");
  EXPECT_EQ(read_line(watcher.stdout_fd), "(no leader)");
  kill(watcher.pid, SIGINT);
  EXPECT_EQ(wait_exit(watcher), 0) << watcher.err();
}

INSTANTIATE_TEST_SUITE_P(Servers, CliServerTest, ::testing::ValuesIn(families()),
                         [](const auto& param_info) { return param_info.param; });

}  // namespace
