// SPDX-License-Identifier: Apache-2.0
// Issue 24: the habits of cron and flock(1) users (-q, -n, -w, -s, -x, -o, a bare NAME) and
// messages that say what really happened. Each test uses its own fresh file:// directory.
#include <set>

#include "cli_support.hpp"

namespace {

using namespace cli_tests;

class CliHabitsTest : public CliTest {
 protected:
  // `turnstile run ARGS... -- sh -c 'echo > READY; wait for RELEASE'`, returned once it runs.
  Process run_until(std::vector<std::string> args, const std::string& ready, const std::string& release) {
    args.insert(args.begin(), {"run", "--backend", backend_});
    args.insert(args.end(),
                {"--", "sh", "-c", "echo x > " + ready + "; while [ ! -e " + release + " ]; do sleep 0.02; done"});
    auto process = start(args);
    EXPECT_TRUE(wait_until([&] { return fs::exists(ready) && !read_file(ready).empty(); }))
        << "the holder never ran; stderr: " << process.err();
    return process;
  }

  // `turnstile run ARGS... -- true` on this test's backend, or on `backend`.
  Result run_true(std::vector<std::string> args, const std::string& backend = {}) {
    args.insert(args.begin(), {"run", "--backend", backend.empty() ? backend_ : backend});
    args.insert(args.end(), {"--", "true"});
    return run(args);
  }
};

// --- item 5: -q/--quiet ------------------------------------------------------------------------

// Cron mails whatever a job prints: with -q a skipped run (busy, or the wait ran out) prints
// nothing, as flock -q; -v still says it, and other errors are still said.
TEST_F(CliHabitsTest, QuietSaysNothingWhenTheNameIsBusy) {
  const auto ready = path("ready"), release = path("release");
  auto holder = hold_until("cronjob", ready, release);
  const auto busy = run(lock_sh("cronjob", "true", {"--timeout", "0", "-E", "0", "-q"}));
  EXPECT_EQ(busy.status, 0);
  EXPECT_EQ(busy.err, "");
  EXPECT_EQ(busy.out, "");
  const auto timed = run(lock_sh("cronjob", "true", {"--timeout", "0.2", "--quiet"}));
  EXPECT_EQ(timed.status, 75);
  EXPECT_EQ(timed.err, "");
  const auto held = run({"hold", "--backend", backend_, "-q", "--timeout", "0", "cronjob"});
  EXPECT_EQ(held.status, 75);
  EXPECT_EQ(held.err, "");
  // Without -q, and with -v, the busy line is there (so the quiet runs above were really busy).
  const auto loud = run(lock_sh("cronjob", "true", {"--timeout", "0"}));
  EXPECT_EQ(loud.status, 75);
  EXPECT_NE(loud.err.find("'cronjob' is busy; held by pid "), std::string::npos) << loud.err;
  const auto verbose = run(lock_sh("cronjob", "true", {"--timeout", "0", "-q", "-v"}));
  EXPECT_EQ(verbose.status, 75);
  EXPECT_NE(verbose.err.find("'cronjob' is busy"), std::string::npos) << verbose.err;
  write_file(release, "");
  EXPECT_EQ(wait_exit(holder), 0);
  // -q hides only the conflict: a bad name is still explained.
  const auto bad = run(lock_sh("a//b", "true", {"-q"}));
  EXPECT_EQ(bad.status, 64);
  EXPECT_NE(bad.err.find("invalid name"), std::string::npos) << bad.err;
}

// A reader of turnstile's output that went away (`2>&1 | head`, a dead log pipe) killed it with
// SIGPIPE at its first -v line, after it had taken the hold and before the command ran (exit 141,
// the state left behind). turnstile ignores SIGPIPE now; the command still gets it as turnstile
// was given it (here: the default, whatever this test process does with it).
TEST_F(CliHabitsTest, AClosedOutputPipeNeitherKillsTurnstileNorLeavesTheCommandDeaf) {
  const auto ran = path("ran"), status = path("status");
  const std::string turnstile = std::string("env --default-signal=PIPE ") + TURNSTILE_CLI_PATH;
  const std::string script = "(sleep 0.3; " + turnstile + " run -v --backend " + backend_ +
                             " pipejob -- sh -c 'grep SigIgn /proc/self/status > " + ran + "'; echo $? > " + status +
                             ") 2>&1 | true";
  EXPECT_EQ(run_program({"/bin/sh", "-c", script}).status, 0);
  ASSERT_TRUE(wait_until([&] { return !read_file(status).empty(); })) << "turnstile never ended";
  EXPECT_EQ(read_file(status), "0\n") << "the command's run did not end well";
  const auto ignored = read_file(ran);
  ASSERT_NE(ignored.find("SigIgn:"), std::string::npos) << "the command never ran";
  // SIGPIPE is signal 13: bit 0x1000 of the hexadecimal mask.
  const auto mask = std::stoull(ignored.substr(ignored.find(':') + 1), nullptr, 16);
  EXPECT_EQ(mask & 0x1000, 0u) << "the command was started with SIGPIPE ignored: " << ignored;
  EXPECT_EQ(run_true({"-n", "pipejob"}).status, 0) << "the name was left held";
}

// --- item 6: flock's flags -----------------------------------------------------------------------

// -n is --timeout 0, -w SECONDS is --timeout SECONDS; a bare NAME is --lock NAME.
TEST_F(CliHabitsTest, NonblockWaitAndABareNameMeanWhatFlocksDo) {
  const auto out = path("out");
  const auto bare = run({"run", "--backend", backend_, "job", "--", "sh", "-c", "echo \"$TURNSTILE_NAME\" > " + out});
  EXPECT_EQ(bare.status, 0) << bare.err;
  EXPECT_EQ(read_file(out), "job\n");
  const auto ready = path("ready"), release = path("release");
  auto holder = hold_until("job", ready, release);  // --lock job: the bare NAME's Mutex
  const auto nonblock = run_true({"-n", "job"});
  EXPECT_EQ(nonblock.status, 75) << nonblock.err;
  EXPECT_NE(nonblock.err.find("'job' is busy"), std::string::npos) << nonblock.err;
  EXPECT_EQ(run_true({"--nonblock", "-E", "3", "job"}).status, 3);
  const auto wait = run_true({"-w", "0.2", "job"});
  EXPECT_EQ(wait.status, 75) << wait.err;
  EXPECT_NE(wait.err.find("timed out after 0.2 s waiting for 'job'"), std::string::npos) << wait.err;
  EXPECT_EQ(run_true({"--wait", "0.2", "--lock", "job"}).status, 75);
  write_file(release, "");
  EXPECT_EQ(wait_exit(holder), 0);
  EXPECT_EQ(run_true({"-n", "job"}).status, 0);
  EXPECT_EQ(run_true({"-w", "1", "job"}).status, 0);
}

// -s and -x are the shared and exclusive sides of one SharedMutex, as flock's on one file.
TEST_F(CliHabitsTest, SharedAndExclusiveAreTheTwoSidesOfOneName) {
  const auto ready = path("ready"), release = path("release");
  auto reader = run_until({"-s", "rw"}, ready, release);
  EXPECT_EQ(run_true({"-n", "-s", "rw"}).status, 0) << "a second shared holder was kept out";
  EXPECT_EQ(run_true({"-n", "--shared", "rw"}).status, 0);
  EXPECT_EQ(run_true({"-n", "--read", "rw"}).status, 0);
  EXPECT_EQ(run_true({"-n", "-x", "rw"}).status, 75);
  EXPECT_EQ(run_true({"-n", "-e", "rw"}).status, 75);
  EXPECT_EQ(run_true({"-n", "--exclusive", "--write", "rw"}).status, 75);
  const auto inspected = inspect_json("rw");
  ASSERT_EQ(inspected["holders"].size(), 1u) << inspected.dump();
  EXPECT_EQ(inspected["holders"][0]["pid"].get<pid_t>(), reader.pid);
  write_file(release, "");
  EXPECT_EQ(wait_exit(reader), 0);
  const auto writer_ready = path("writer-ready"), writer_release = path("writer-release");
  auto writer = run_until({"-x", "rw"}, writer_ready, writer_release);
  EXPECT_EQ(run_true({"-n", "-s", "rw"}).status, 75);
  EXPECT_EQ(run({"hold", "--backend", backend_, "-n", "-s", "rw"}).status, 75);
  write_file(writer_release, "");
  EXPECT_EQ(wait_exit(writer), 0);
  EXPECT_EQ(run_true({"-n", "-s", "rw"}).status, 0);
}

TEST_F(CliHabitsTest, FlockFormsThatContradictGive64AndChangeNothing) {
  const std::vector<std::vector<std::string>> bad = {
      {"-n", "-w", "1", "job"},
      {"-n", "--timeout", "1", "job"},
      {"-w", "1", "--timeout", "1", "job"},
      {"-w", "-1", "job"},
      {"-w", "x", "job"},
      {"-s", "-x", "job"},
      {"-s", "--lock", "job"},
      {"-s", "--write", "job"},
      {"-x", "--read", "job"},
      {"-x", "--semaphore", "job", "--limit", "2"},
      {"job", "--lock", "other"},
      {"-s"},
  };
  for (const auto& args : bad) {
    std::string joined;
    for (const auto& a : args) joined += a + " ";
    const auto result = run_true(args);
    EXPECT_EQ(result.status, 64) << joined << "\nstderr: " << result.err;
    EXPECT_NE(result.err.find("turnstile: "), std::string::npos) << joined;
  }
  EXPECT_FALSE(fs::exists(backend_dir_)) << "a usage error touched the backend";
  const auto nothing = run_true({"-w", "1"});
  EXPECT_EQ(nothing.status, 64);
  EXPECT_NE(nothing.err.find("give a NAME, or exactly one of --lock"), std::string::npos) << nothing.err;
  // `run --lock job true`: "true" is taken for NAME; the hint says where the command goes.
  const auto no_dashes = run({"run", "--backend", backend_, "--lock", "job", "true"});
  EXPECT_EQ(no_dashes.status, 64);
  EXPECT_NE(no_dashes.err.find("put the command to run after '--'"), std::string::npos) << no_dashes.err;
}

// flock -o: the lock is not held on behalf of what the command started in the background. With
// -o, turnstile releases when COMMAND exits and leaves those processes running; without it, it
// stops them before releasing.
TEST_F(CliHabitsTest, CloseReleasesWhenTheCommandExitsAndLeavesItsChildrenRunning) {
  const auto pid_file = path("background");
  const auto closed = run({"run", "--backend", backend_, "-o", "job", "--", "sh", "-c",
                           "sleep 30 </dev/null >/dev/null 2>&1 & echo $! > " + pid_file});
  EXPECT_EQ(closed.status, 0) << closed.err;
  EXPECT_EQ(closed.err.find("left processes"), std::string::npos) << closed.err;
  const auto background = static_cast<pid_t>(read_number(pid_file));
  ASSERT_GT(background, 0);
  EXPECT_FALSE(gone(background)) << "-o stopped the command's background process";
  EXPECT_EQ(run_true({"-n", "job"}).status, 0) << "the name stayed held after the command exited";
  kill(background, SIGKILL);
  EXPECT_TRUE(wait_until([&] { return gone(background); }));
  // Without -o the background process is stopped before the release.
  const auto stopped = run({"run", "--backend", backend_, "--grace", "0.1", "job", "--", "sh", "-c",
                            "sleep 30 </dev/null >/dev/null 2>&1 & echo $! > " + pid_file});
  EXPECT_EQ(stopped.status, 0) << stopped.err;
  const auto second = static_cast<pid_t>(read_number(pid_file));
  EXPECT_TRUE(wait_until([&] { return gone(second); }));
}

// CLI11 lists arguments it did not expect last first ("not expected: 1 -w"): they are said in
// the order the user typed them.
TEST_F(CliHabitsTest, UnexpectedArgumentsAreListedInTheUsersOrder) {
  const auto unknown = run({"run", "--backend", backend_, "--lock", "job", "--bogus", "--other", "--", "true"});
  EXPECT_EQ(unknown.status, 64);
  EXPECT_NE(unknown.err.find("not expected: --bogus --other\n"), std::string::npos) << unknown.err;
  const auto extra = run({"hold", "--backend", backend_, "job", "first", "second"});
  EXPECT_EQ(extra.status, 64);
  EXPECT_NE(extra.err.find("not expected: first second\n"), std::string::npos) << extra.err;
}

TEST_F(CliHabitsTest, HelpAndManPageListTheFlockFlags) {
  const auto help = run({"run", "--help"});
  EXPECT_EQ(help.status, 0);
  for (const std::string expected :
       {"-q,--quiet", "-n,--nonblock", "-w,--wait", "-s,--shared", "-x,-e,--exclusive", "-o,--close", "NAME"}) {
    EXPECT_NE(help.out.find(expected), std::string::npos) << expected << " missing from:\n" << help.out;
  }
}

// --- item 10: messages that say what happened ------------------------------------------------------

// A limit too large for the number type was reported as the clamped 9223372036854775807.
TEST_F(CliHabitsTest, AnOutOfRangeLimitIsQuotedAsGiven) {
  const auto huge = run_true({"--semaphore", "s", "--limit", "99999999999999999999"});
  EXPECT_EQ(huge.status, 64);
  EXPECT_NE(huge.err.find("got '99999999999999999999'"), std::string::npos) << huge.err;
  EXPECT_EQ(huge.err.find("9223372036854775807"), std::string::npos) << huge.err;
  const auto above = run_true({"--semaphore", "s", "--limit", "2000000000000"});
  EXPECT_EQ(above.status, 64);
  EXPECT_NE(above.err.find("from 1 to 1000000000000, got 2000000000000"), std::string::npos) << above.err;
  EXPECT_FALSE(fs::exists(backend_dir_));
}

// The unknown-scheme message names every scheme the library takes.
TEST_F(CliHabitsTest, TheUnknownSchemeMessageNamesEveryScheme) {
  const auto unknown = run_true({"job"}, "nosuch://127.0.0.1:1");
  EXPECT_EQ(unknown.status, 64);
  const auto listed = schemes_listed(unknown.err);
  const std::set<std::string> named(listed.begin(), listed.end());
  const std::set<std::string> schemes{"file",          "redis",          "rediss", "redis+sentinel", "rediss+sentinel",
                                      "redis+cluster", "rediss+cluster", "zk",     "etcd",           "etcds",
                                      "consul",        "consuls"};
  EXPECT_EQ(named, schemes) << unknown.err;
}

// A bad URL the user did not type says where it came from: TURNSTILE_BACKEND, CONSUL_HTTP_ADDR.
TEST_F(CliHabitsTest, ABadUrlFromTheEnvironmentSaysWhereItCameFrom) {
  Launch from_env;
  from_env.env = {{"TURNSTILE_BACKEND", "nosuch://127.0.0.1:1"}};
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"run", "job", "--", "true"}, {"hold", "--timeout", "0", "job"}, {"inspect", "job"}}) {
    const auto result = run(args, from_env);
    EXPECT_EQ(result.status, 64) << args.front();
    EXPECT_NE(result.err.find("unknown backend scheme 'nosuch'"), std::string::npos) << result.err;
    EXPECT_NE(result.err.find("came from TURNSTILE_BACKEND"), std::string::npos) << args.front() << ": " << result.err;
  }
  // Given on the command line, it needs no such note.
  const auto given = run_true({"job"}, "nosuch://127.0.0.1:1");
  EXPECT_EQ(given.err.find("TURNSTILE_BACKEND"), std::string::npos) << given.err;

  Launch consul_env;
  consul_env.env = {{"CONSUL_HTTP_ADDR", "127.0.0.1:99999"}};
  const auto consul = run({"run", "--backend", "consul://", "job", "--", "true"}, consul_env);
  if (consul.err.find("not installed") != std::string::npos) GTEST_SKIP() << consul.err;
  EXPECT_EQ(consul.status, 64) << consul.err;
  EXPECT_NE(consul.err.find("bad port '99999'"), std::string::npos) << consul.err;
  EXPECT_NE(consul.err.find("came from CONSUL_HTTP_ADDR"), std::string::npos) << consul.err;
}

// The unknown-parameter message lists every parameter the backend takes (Redis: eviction too).
TEST_F(CliHabitsTest, TheUnknownRedisParameterMessageListsEviction) {
  const auto typo = run_true({"job"}, "redis://127.0.0.1:1?evict=allow");
  if (typo.err.find("not installed") != std::string::npos) GTEST_SKIP() << typo.err;
  EXPECT_EQ(typo.status, 64) << typo.err;
  EXPECT_NE(typo.err.find("unknown parameter 'evict'"), std::string::npos) << typo.err;
  EXPECT_NE(typo.err.find("eviction"), std::string::npos) << typo.err;
}

// etcd leases count whole seconds (as the README says): a fraction is refused before anything is
// touched, not rounded up silently; a parameter given twice is refused too.
TEST_F(CliHabitsTest, EtcdRefusesAFractionalTtl) {
  const std::string etcd = "etcd://127.0.0.1:1";
  const auto option = run_true({"--connect-timeout", "1", "--ttl", "1.5", "job"}, etcd);
  if (option.err.find("not installed") != std::string::npos) GTEST_SKIP() << option.err;
  EXPECT_EQ(option.status, 64) << option.err;
  EXPECT_NE(option.err.find("whole number of seconds"), std::string::npos) << option.err;
  const auto query = run_true({"--connect-timeout", "1", "job"}, etcd + "?ttl=1.5");
  EXPECT_EQ(query.status, 64) << query.err;
  EXPECT_NE(query.err.find("whole number of seconds"), std::string::npos) << query.err;
  const auto twice = run_true({"--connect-timeout", "1", "job"}, etcd + "?ttl=5&ttl=6");
  EXPECT_EQ(twice.status, 64) << twice.err;
  EXPECT_NE(twice.err.find("'ttl' is given more than once"), std::string::npos) << twice.err;
  // Whole seconds are taken: nothing listens, so it is the connection that fails.
  EXPECT_EQ(run_true({"--connect-timeout", "1", "job"}, etcd + "?ttl=5").status, 69);
}

// --- issue 28's leftovers: --events FILE, gc -v, elect -n ------------------------------------

// A FIFO nobody reads hung turnstile at open() for good, before it held anything. It is refused
// at once now, as a file it cannot create: exit 73 (EX_CANTCREAT), the command not run.
TEST_F(CliHabitsTest, AnEventsFifoWithoutAReaderIsRefusedAtOnce) {
  const auto fifo = path("events.fifo"), ran = path("ran");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const auto unread = run(lock_sh("job", "touch " + ran, {"--events", fifo}));
  EXPECT_EQ(unread.status, 73) << unread.err;
  EXPECT_NE(unread.err.find("cannot open --events file '" + fifo + "': no process reads the FIFO"), std::string::npos)
      << unread.err;
  EXPECT_FALSE(fs::exists(ran));
  // With a reader the FIFO takes the events, as a file does.
  const int reader = open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  ASSERT_GE(reader, 0);
  const auto read_by = run(lock_sh("job", "touch " + ran, {"--events", fifo}));
  EXPECT_EQ(read_by.status, 0) << read_by.err;
  char lines[4096];
  const auto got = read(reader, lines, sizeof lines);
  close(reader);
  ASSERT_GT(got, 0);
  EXPECT_NE(std::string(lines, static_cast<std::size_t>(got)).find("\"event\":\"acquired\""), std::string::npos);
  EXPECT_TRUE(fs::exists(ran));
}

// A path --events cannot create (a missing directory, a directory) exited 71, the status of a
// failed fork: it is the user's output file that cannot be made, 73, before anything is held.
TEST_F(CliHabitsTest, AnEventsFileThatCannotBeCreatedGives73) {
  const auto ran = path("ran");
  for (const auto& bad : {path("no/such/dir/events"), dir_}) {
    const auto result = run(lock_sh("job", "touch " + ran, {"--events", bad}));
    EXPECT_EQ(result.status, 73) << bad << ": " << result.err;
    EXPECT_NE(result.err.find("cannot open --events file '" + bad + "': "), std::string::npos) << result.err;
    EXPECT_FALSE(fs::exists(ran));
  }
  const auto hold = run({"hold", "--backend", backend_, "--events", path("no/such/dir/events"), "job"});
  EXPECT_EQ(hold.status, 73) << hold.err;
}

// -v on every other subcommand says what happened: gc -v says how many names' state it removed
// and where (refused with 64 before).
TEST_F(CliHabitsTest, GcVerboseSaysHowManyNamesItRemovedAndWhere) {
  const auto none = run({"gc", "-v", "--backend", backend_});
  EXPECT_EQ(none.status, 0) << none.err;
  EXPECT_EQ(none.out, "");
  EXPECT_NE(none.err.find("removed the state of 0 unused names on "), std::string::npos) << none.err;
  EXPECT_NE(none.err.find(backend_dir_), std::string::npos) << none.err;
  auto killed = hold_until("deploy/killed", path("ready"), path("never"));
  kill(killed.pid, SIGKILL);
  wait_exit(killed);
  // The killed run's watcher keeps the name in use until it has ended the command.
  Result gc{};
  EXPECT_TRUE(wait_until([&] {
    gc = run({"gc", "--verbose", "--backend", backend_, "deploy/"});
    return gc.out == "removed deploy/killed\n";
  })) << gc.out
      << gc.err;
  EXPECT_EQ(gc.status, 0) << gc.err;
  EXPECT_NE(gc.err.find("removed the state of 1 unused name under 'deploy/' on "), std::string::npos) << gc.err;
}

// elect -n is one try, as run -n (flock -n): not won, it exits as run -n does when busy (75).
TEST_F(CliHabitsTest, ElectNonblockIsOneTry) {
  const auto ready = path("ready"), release = path("release"), ran = path("ran");
  auto leader = start({"elect", "--backend", backend_, "primary", "--", "sh", "-c",
                       "echo x > " + ready + "; while [ ! -e " + release + " ]; do sleep 0.02; done"});
  ASSERT_TRUE(wait_until([&] { return fs::exists(ready) && !read_file(ready).empty(); })) << leader.err();
  const auto lost = run({"elect", "--backend", backend_, "-n", "primary", "--", "touch", ran});
  EXPECT_EQ(lost.status, 75) << lost.err;
  EXPECT_FALSE(fs::exists(ran));
  const auto both = run({"elect", "--backend", backend_, "-n", "--timeout", "5", "primary", "--", "touch", ran});
  EXPECT_EQ(both.status, 64) << both.err;
  EXPECT_NE(both.err.find("give one of -n/--nonblock and --timeout"), std::string::npos) << both.err;
  write_file(release, "");
  EXPECT_EQ(wait_exit(leader), 0);
  const auto won = run({"elect", "--backend", backend_, "--nonblock", "primary", "--", "touch", ran});
  EXPECT_EQ(won.status, 0) << won.err;
  EXPECT_TRUE(fs::exists(ran));
}

}  // namespace
