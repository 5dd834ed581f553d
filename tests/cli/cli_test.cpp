// SPDX-License-Identifier: Apache-2.0
// The `turnstile` command as users run it: a separate process, exit statuses, the child's
// environment and signals, loss, and inspect/demo output. Every test uses its own fresh
// file:// directory. Waits are bounded polls with generous deadlines, never speed assertions.
#include "cli_support.hpp"

namespace {

using namespace cli_tests;

// --- exit statuses ---------------------------------------------------------------------------

TEST_F(CliTest, ChildExitStatusPassesThrough) {
  EXPECT_EQ(run(lock_sh("job", "exit 0")).status, 0);
  EXPECT_EQ(run(lock_sh("job", "exit 7")).status, 7);
  EXPECT_EQ(run(lock_sh("job", "exit 255")).status, 255);
}

TEST_F(CliTest, ChildKilledBySignalGives128PlusSignal) {
  EXPECT_EQ(run(lock_sh("job", "kill -KILL $$")).status, 128 + SIGKILL);
  EXPECT_EQ(run(lock_sh("job", "kill -USR1 $$")).status, 128 + SIGUSR1);
}

TEST_F(CliTest, TimeoutWhileAnotherRunHoldsGives75) {
  const auto ready = path("ready"), release = path("release");
  auto holder = hold_until("job", ready, release);
  const auto marker = path("ran");
  auto timed = run(lock_sh("job", "touch " + marker, {"--timeout", "0.3"}));
  EXPECT_EQ(timed.status, 75) << timed.err;
  EXPECT_NE(timed.err.find("turnstile: "), std::string::npos);
  auto once = run(lock_sh("job", "touch " + marker, {"--timeout", "0"}));
  EXPECT_EQ(once.status, 75) << once.err;
  EXPECT_FALSE(fs::exists(marker));
  write_file(release, "");
  EXPECT_EQ(wait_exit(holder), 0);
  // Free again: try-once succeeds.
  EXPECT_EQ(run(lock_sh("job", "touch " + marker, {"--timeout", "0"})).status, 0);
  EXPECT_TRUE(fs::exists(marker));
}

// Issue 13: the habits of flock(1) users: -c 'COMMAND LINE', -E/--conflict-exit-code, a busy
// message that names the holder, --version, and a --help that lists exit codes and variables.
TEST_F(CliTest, ShellOptionRunsACommandLineWithTheHoldsVariables) {
  const auto out = path("out");
  EXPECT_EQ(run({"run", "--backend", backend_, "--lock", "job", "-c", "echo \"$TURNSTILE_NAME\" > " + out}).status, 0);
  EXPECT_EQ(read_file(out), "job\n");
  const auto both = run({"run", "--backend", backend_, "--lock", "job", "-c", "true", "--", "true"});
  EXPECT_EQ(both.status, 64) << both.err;
  EXPECT_EQ(run({"run", "--backend", backend_, "--lock", "job", "-c", ""}).status, 64);
}

TEST_F(CliTest, ConflictExitCodeIsTheStatusWhenBusyAndTheHolderIsNamed) {
  const auto ready = path("ready"), release = path("release");
  auto holder = hold_until("job", ready, release);
  const auto busy = run(lock_sh("job", "true", {"--timeout", "0", "--conflict-exit-code", "3"}));
  EXPECT_EQ(busy.status, 3) << busy.err;
  EXPECT_NE(busy.err.find("is busy; held by pid "), std::string::npos) << busy.err;
  const auto timed = run(lock_sh("job", "true", {"--timeout", "0.2", "-E", "0"}));
  EXPECT_EQ(timed.status, 0) << timed.err;
  EXPECT_NE(timed.err.find("timed out after 0.2 s waiting for 'job'; held by pid "), std::string::npos) << timed.err;
  EXPECT_EQ(run(lock_sh("job", "true", {"--timeout", "0", "-E", "256"})).status, 64);
  write_file(release, "");
  EXPECT_EQ(wait_exit(holder), 0);
}

TEST_F(CliTest, VersionAndHelpSayWhatTheyShould) {
  const auto version = run({"--version"});
  EXPECT_EQ(version.status, 0);
  EXPECT_EQ(version.out.rfind("turnstile ", 0), 0u) << version.out;
  const auto help = run({"run", "--help"});
  EXPECT_EQ(help.status, 0);
  for (const std::string expected :
       {"-- COMMAND", "-c 'COMMAND LINE'", "TURNSTILE_FENCING_TOKEN", "TURNSTILE_NAME", "75  busy",
        "69  the backend cannot be reached", "--connect-timeout", "--conflict-exit-code", "--holder-label"}) {
    EXPECT_NE(help.out.find(expected), std::string::npos) << expected << " missing from:\n" << help.out;
  }
  for (const std::string expected : {"-v,--verbose", "-E,--conflict-exit-code"}) {
    EXPECT_NE(help.out.find(expected), std::string::npos) << expected << " missing from:\n" << help.out;
  }
  const auto hold_help = run({"hold", "--help"});
  EXPECT_EQ(hold_help.status, 0);
  for (const std::string expected : {"turnstile hold [OPTIONS] NAME", "coproc", "stdin", "70  the hold was lost",
                                     "75  busy", "--holder-label", "--connect-timeout"}) {
    EXPECT_NE(hold_help.out.find(expected), std::string::npos) << expected << " missing from:\n" << hold_help.out;
  }
  const auto inspect_help = run({"inspect", "--help"});
  for (const std::string expected : {"--watch", "--interval", "--json", "docs/inspect-json.md"}) {
    EXPECT_NE(inspect_help.out.find(expected), std::string::npos) << expected << " missing from:\n" << inspect_help.out;
  }
  const auto top_help = run({"--help"});
  EXPECT_NE(top_help.out.find("hold"), std::string::npos) << top_help.out;
  const auto unknown = run({"frobnicate"});
  EXPECT_EQ(unknown.status, 64);
  EXPECT_NE(unknown.err.find(
                "unknown subcommand 'frobnicate' (expected run, hold, elect, leader, inspect, gc, serve or demo)"),
            std::string::npos)
      << unknown.err;
}

// A scheme is named as supported (the unknown-scheme error lists them) only if its backend
// exists: each one listed is known to the library (built here, or said not to be installed),
// never "unknown".
TEST_F(CliTest, EverySchemeNamedAsSupportedHasABackend) {
  const auto unknown = run({"inspect", "--backend", "nosuch://127.0.0.1:1", "job"});
  EXPECT_EQ(unknown.status, 64);
  const auto schemes = schemes_listed(unknown.err);
  EXPECT_GE(schemes.size(), 2u) << unknown.err;
  for (const auto& scheme : schemes) {
    if (scheme == "file") continue;  // this test's own backend
    // Nothing listens on port 1: a backend that exists says it cannot reach it (69), or that it
    // is not installed in this build.
    // A Sentinel URL names its master.
    const std::string where = scheme.ends_with("+sentinel") ? "://127.0.0.1:1/master" : "://127.0.0.1:1";
    const auto result = run({"inspect", "--connect-timeout", "1", "--backend", scheme + where, "job"});
    EXPECT_EQ(result.err.find("unknown backend scheme"), std::string::npos) << scheme << ": " << result.err;
    EXPECT_TRUE(result.status == 69 || result.err.find("not installed") != std::string::npos)
        << scheme << ": " << result.status << " " << result.err;
  }
}

// --- -v/--verbose --------------------------------------------------------------------------------

// -v says on stderr what it waits for and on which backend, who holds it, when it got it and its
// fencing token (the one the command sees), and that it released it; without -v nothing.
TEST_F(CliTest, VerboseSaysWhatItWaitsForWhoHoldsItWhenItGotItAndItsToken) {
  const auto ready = path("ready"), release = path("release"), token_file = path("token");
  auto holder = hold_until("job", ready, release);
  auto waiter = start(lock_sh("job", "echo $TURNSTILE_FENCING_TOKEN > " + token_file, {"-v"}));
  ASSERT_TRUE(wait_until([&] { return waiter_count_is("job", 1); })) << waiter.err();
  const auto waiting = waiter.err();
  EXPECT_NE(waiting.find("turnstile: waiting for the lock 'job' on " + backend_), std::string::npos) << waiting;
  EXPECT_NE(waiting.find("held by pid " + std::to_string(holder.pid) + "@"), std::string::npos) << waiting;
  EXPECT_EQ(waiting.find("got the lock"), std::string::npos) << waiting;
  write_file(release, "");
  EXPECT_EQ(wait_exit(holder), 0);
  EXPECT_EQ(wait_exit(waiter), 0) << waiter.err();
  const auto token = std::to_string(read_number(token_file));
  const auto err = waiter.err();
  EXPECT_NE(err.find("turnstile: got the lock 'job' on " + backend_ + " at "), std::string::npos) << err;
  EXPECT_NE(err.find("; fencing token " + token + "\n"), std::string::npos) << err;
  EXPECT_NE(err.find("turnstile: released the lock 'job'"), std::string::npos) << err;

  const auto semaphore = run({"run", "-v", "--backend", backend_, "--semaphore", "pool", "--limit", "2", "--", "true"});
  EXPECT_EQ(semaphore.status, 0) << semaphore.err;
  EXPECT_NE(semaphore.err.find("got a lease of the semaphore 'pool' (limit 2)"), std::string::npos) << semaphore.err;
  const auto quiet = run(lock_sh("job", "true"));
  EXPECT_EQ(quiet.status, 0);
  EXPECT_EQ(quiet.err, "");
}

// --events FILE appends each event of the hold as a JSON line: acquired with the token the
// command sees, then released; a FILE it cannot open is said, and nothing runs.
TEST_F(CliTest, EventsAppendsEachEventOfTheHoldAsAJsonLine) {
  const auto events = path("events"), token_file = path("token");
  const auto result = run(lock_sh("job", "echo $TURNSTILE_FENCING_TOKEN > " + token_file, {"--events", events}));
  ASSERT_EQ(result.status, 0) << result.err;
  EXPECT_EQ(result.err, "");
  const auto token = std::to_string(read_number(token_file));
  const auto lines = read_file(events);
  const auto first_end = lines.find('\n');
  ASSERT_NE(first_end, std::string::npos) << lines;
  const auto first = lines.substr(0, first_end), second = lines.substr(first_end + 1);
  EXPECT_NE(first.find("\"event\":\"acquired\""), std::string::npos) << lines;
  EXPECT_NE(first.find("\"name\":\"job\",\"fencing_token\":" + token + ","), std::string::npos) << lines;
  EXPECT_NE(second.find("\"event\":\"released\""), std::string::npos) << lines;
  EXPECT_NE(second.find("\"fencing_token\":" + token + ","), std::string::npos) << lines;
  EXPECT_EQ(std::count(lines.begin(), lines.end(), '\n'), 2) << lines;

  const auto ran = path("ran");
  const auto unopened = run(lock_sh("job", "touch " + ran, {"--events", path("no/such/dir/events")}));
  EXPECT_EQ(unopened.status, 73) << unopened.err;
  EXPECT_NE(unopened.err.find("cannot open --events file"), std::string::npos) << unopened.err;
  EXPECT_FALSE(std::filesystem::exists(ran));
}

// --- hold ------------------------------------------------------------------------------------------

// `turnstile hold NAME`: the token on stdout once held, held (by the hold process) until its
// stdin, a pipe, closes; then released, exit 0.
TEST_F(CliTest, HoldPrintsTheTokenAndKeepsTheHoldUntilStdinCloses) {
  Launch pipes;
  pipes.stdin_pipe = pipes.stdout_pipe = true;
  auto holder = start({"hold", "--backend", backend_, "jobs/region"}, pipes);
  const auto token = read_line(holder.stdout_fd);
  ASSERT_FALSE(token.empty()) << holder.err();
  const auto q = inspect_json("jobs/region");
  ASSERT_EQ(q["holders"].size(), 1u) << q.dump();
  EXPECT_EQ(q["holders"][0]["pid"].get<pid_t>(), holder.pid);
  EXPECT_EQ(std::to_string(q["holders"][0]["fencing_token"].get<std::uint64_t>()), token);
  EXPECT_EQ(run(lock_sh("jobs/region", "true", {"--timeout", "0"})).status, 75);
  // Bytes on stdin are not its end.
  ASSERT_EQ(write(holder.stdin_fd, "x\n", 2), 2);
  EXPECT_EQ(run(lock_sh("jobs/region", "true", {"--timeout", "0"})).status, 75);
  close_pipe(holder.stdin_fd);
  EXPECT_EQ(wait_exit(holder), 0) << holder.err();
  EXPECT_EQ(holder.err(), "");
  EXPECT_EQ(run(lock_sh("jobs/region", "true", {"--timeout", "0"})).status, 0) << "not released";
}

// Process substitution (`exec 3< <(turnstile hold x)`): stdin is not a pipe of the script's;
// when the script closes its end of stdout (or exits), the hold ends.
TEST_F(CliTest, HoldEndsWhenTheReaderOfItsOutputGoes) {
  Launch out_pipe;
  out_pipe.stdout_pipe = true;  // stdin is /dev/null: never read, never its end
  auto holder = start({"hold", "--backend", backend_, "--lock", "job"}, out_pipe);
  ASSERT_FALSE(read_line(holder.stdout_fd).empty()) << holder.err();
  EXPECT_EQ(run(lock_sh("job", "true", {"--timeout", "0"})).status, 75);
  EXPECT_EQ(waitpid(holder.pid, nullptr, WNOHANG), 0) << "it let go although stdout's reader was still there";
  close_pipe(holder.stdout_fd);
  EXPECT_EQ(wait_exit(holder), 0) << holder.err();
  EXPECT_EQ(run(lock_sh("job", "true", {"--timeout", "0"})).status, 0) << "not released";
}

TEST_F(CliTest, HoldWhenBusyPrintsNothingAndGivesTheConflictStatus) {
  const auto ready = path("ready"), release = path("release");
  auto holder = hold_until("job", ready, release);
  const auto busy = run({"hold", "--backend", backend_, "--timeout", "0", "-E", "9", "job"});
  EXPECT_EQ(busy.status, 9) << busy.err;
  EXPECT_EQ(busy.out, "");
  EXPECT_NE(busy.err.find("'job' is busy; held by pid " + std::to_string(holder.pid) + "@"), std::string::npos)
      << busy.err;
  const auto timed = run({"hold", "--backend", backend_, "--timeout", "0.2", "job"});
  EXPECT_EQ(timed.status, 75) << timed.err;
  EXPECT_EQ(timed.out, "");
  write_file(release, "");
  EXPECT_EQ(wait_exit(holder), 0);
}

// --semaphore, --read and --write hold as they run; a token per hold.
TEST_F(CliTest, HoldTakesSemaphoreLeasesAndSharedSides) {
  Launch pipes;
  pipes.stdin_pipe = pipes.stdout_pipe = true;
  auto first = start({"hold", "--backend", backend_, "--semaphore", "pool", "--limit", "2"}, pipes);
  auto second = start({"hold", "--backend", backend_, "--semaphore", "pool", "--limit", "2"}, pipes);
  const auto first_token = read_line(first.stdout_fd), second_token = read_line(second.stdout_fd);
  ASSERT_FALSE(first_token.empty()) << first.err();
  ASSERT_FALSE(second_token.empty()) << second.err();
  EXPECT_NE(first_token, second_token);
  EXPECT_EQ(run({"hold", "--backend", backend_, "--timeout", "0", "--semaphore", "pool", "--limit", "2"}).status, 75);
  auto reader = start({"hold", "--backend", backend_, "--read", "rw"}, pipes);
  ASSERT_FALSE(read_line(reader.stdout_fd).empty()) << reader.err();
  EXPECT_EQ(run({"run", "--backend", backend_, "--timeout", "0", "--read", "rw", "--", "true"}).status, 0);
  EXPECT_EQ(run({"hold", "--backend", backend_, "--timeout", "0", "--write", "rw"}).status, 75);
  for (auto* process : {&first, &second, &reader}) {
    close_pipe(process->stdin_fd);
    EXPECT_EQ(wait_exit(*process), 0) << process->err();
  }
  EXPECT_EQ(run({"run", "--backend", backend_, "--timeout", "0", "--write", "rw", "--", "true"}).status, 0);
}

TEST_F(CliTest, HoldLostGives70) {
  Launch pipes;
  pipes.stdin_pipe = pipes.stdout_pipe = true;
  auto holder = start({"hold", "--backend", backend_, "job"}, pipes);
  ASSERT_FALSE(read_line(holder.stdout_fd).empty()) << holder.err();
  fs::remove_all(backend_dir_);  // the embedded backend's state is gone: the hold may be lost
  EXPECT_EQ(wait_exit(holder), 70) << holder.err();
  EXPECT_NE(holder.err().find("may have been lost"), std::string::npos) << holder.err();
}

// The shell idioms the help shows: a region of a bash script under the lock, by coproc and by
// process substitution; `wait` says whether the hold was kept throughout.
TEST_F(CliTest, HoldLocksARegionOfAShellScript) {
  if (!fs::exists("/bin/bash")) GTEST_SKIP() << "no bash";
  const std::string cli = TURNSTILE_CLI_PATH;
  const auto script = path("region.sh");
  write_file(script,
             "set -u\n"
             "T=" +
                 cli + "; B=" + backend_ +
                 "\n"
                 "coproc HOLD { \"$T\" hold --backend \"$B\" jobs/x; }\n"
                 // Kept at once: bash unsets HOLD_PID when it reaps the ended coprocess.
                 "hold_pid=$HOLD_PID\n"
                 "read -r token <&\"${HOLD[0]}\" || { echo 'not held'; exit 1; }\n"
                 "echo \"token $token\"\n"
                 "\"$T\" run --backend \"$B\" --timeout 0 --lock jobs/x -- true 2>/dev/null; echo \"inside $?\"\n"
                 "exec {HOLD[1]}>&-\n"
                 "wait \"$hold_pid\"; echo \"kept $?\"\n"
                 "\"$T\" run --backend \"$B\" --timeout 0 --lock jobs/x -- true; echo \"after $?\"\n"
                 "exec 3< <(\"$T\" hold --backend \"$B\" jobs/y </dev/null)\n"
                 "held=$!\n"
                 "read -r token <&3 || exit 1\n"
                 "\"$T\" run --backend \"$B\" --timeout 0 --lock jobs/y -- true 2>/dev/null; echo \"inside $?\"\n"
                 "exec 3<&-\n"
                 "wait $held; echo \"kept $?\"\n"
                 "\"$T\" run --backend \"$B\" --timeout 0 --lock jobs/y -- true; echo \"after $?\"\n");
  const auto result = run_program({"/bin/bash", script});
  EXPECT_EQ(result.status, 0) << result.err;
  std::istringstream lines(result.out);
  std::string token_line;
  std::getline(lines, token_line);
  EXPECT_TRUE(token_line.starts_with("token ") && token_line.size() > 6) << result.out;
  std::string rest((std::istreambuf_iterator<char>(lines)), std::istreambuf_iterator<char>());
  EXPECT_EQ(rest, "inside 75\nkept 0\nafter 0\ninside 75\nkept 0\nafter 0\n") << result.out << result.err;
}

TEST_F(CliTest, UsageErrorsGive64) {
  const std::vector<std::vector<std::string>> bad = {
      {"run", "--backend", backend_, "--lock", "a//b", "--", "true"},  // bad name
      {"run", "--backend", backend_, "--lock", "job"},                 // no command
      {"run", "--backend", backend_, "--lock", "job", "--"},           // empty command
      {"run", "--backend", backend_, "--lock", "job", "true"},         // command without --
      {"run", "--backend", backend_, "--semaphore", "s", "--limit", "0", "--", "true"},
      {"run", "--backend", backend_, "--semaphore", "s", "--limit", "-2", "--", "true"},
      {"run", "--backend", backend_, "--semaphore", "s", "--limit", "x", "--", "true"},
      {"run", "--backend", backend_, "--semaphore", "s", "--", "true"},  // no --limit
      {"run", "--backend", backend_, "--lock", "s", "--limit", "2", "--", "true"},
      {"run", "--backend", backend_, "--lock", "a", "--write", "b", "--", "true"},
      {"run", "--backend", backend_, "--", "true"},  // no primitive
      {"run", "--backend", backend_, "--lock", "job", "--timeout", "-1", "--", "true"},
      {"run", "--backend", backend_, "--lock", "job", "--grace", "-1", "--", "true"},
      {"run", "--backend", "nosuch://host/x", "--lock", "job", "--", "true"},  // unknown scheme
      {"run", "--backend", "file://relative", "--lock", "job", "--", "true"},  // malformed file URL
      {"run", "--backend", backend_, "--lock", "job", "--connect-timeout", "0", "--", "true"},
      {"run", "--backend", backend_, "--lock", "job", "--connect-timeout", "x", "--", "true"},
      {"run", "--backend", backend_, "--lock", "job", "--holder-label", "a\x01b", "--", "true"},
      {"hold", "--backend", backend_},                      // nothing to hold
      {"hold", "--backend", backend_, "a", "--lock", "b"},  // NAME and --lock
      {"hold", "--backend", backend_, "--semaphore", "s"},  // no --limit
      {"hold", "--backend", backend_, "--connect-timeout", "-1", "job"},
      {"hold", "--backend", backend_, "a//b"},
      {"hold", "--backend", backend_, "job", "--", "true"},  // hold runs nothing
      {"inspect", "--backend", backend_, "--connect-timeout", "0", "job"},
      {"inspect", "--backend", backend_, "--watch", "--interval", "0", "job"},
      {"inspect", "--backend", backend_, "a//b"},
      {"inspect", "--backend", "nosuch://x", "job"},
      {"demo", "parking", "--cars", "0"},
      {"demo", "parking", "--cars", "1001"},
      {"demo", "parking", "--spaces", "0"},
      {"no-such-subcommand"},
      {},
  };
  for (const auto& args : bad) {
    const auto result = run(args);
    std::string joined;
    for (const auto& a : args) joined += a + " ";
    EXPECT_EQ(result.status, 64) << joined << "\nstderr: " << result.err;
    EXPECT_NE(result.err.find("turnstile: "), std::string::npos) << joined;
  }
}

TEST_F(CliTest, HelpExitsZero) {
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"--help"}, {"run", "--help"}, {"inspect", "--help"}, {"demo", "parking", "--help"}}) {
    const auto result = run(args);
    EXPECT_EQ(result.status, 0) << result.err;
    EXPECT_NE(result.out.find("Usage"), std::string::npos);
  }
}

TEST_F(CliTest, UnusableBackendGives69) {
  // Under a regular file: the directory cannot be created.
  write_file(path("plain-file"), "x");
  const auto under_file =
      run({"run", "--backend", "file://" + path("plain-file") + "/sub", "--lock", "job", "--", "true"});
  EXPECT_EQ(under_file.status, 69) << under_file.err;
  const auto inspect_under_file = run({"inspect", "--backend", "file://" + path("plain-file") + "/sub", "job"});
  EXPECT_EQ(inspect_under_file.status, 69) << inspect_under_file.err;
}

// A lock name no other run of the tests uses (for the shared default directory).
std::string unique_job() { return "cli-test-job-" + std::to_string(getpid()); }

// Permission problems with the state directory are EX_NOPERM (77), not "unavailable" (69).
// Only root can make another user's directories for the test.
TEST_F(CliTest, PermissionProblemsGive77) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to make directories of another user";
  const uid_t nobody = 65534;
  // A state directory owned by another user.
  const auto foreign = path("foreign");
  ASSERT_EQ(mkdir(foreign.c_str(), 0700), 0);
  ASSERT_EQ(chown(foreign.c_str(), nobody, nobody), 0);
  const auto marker = path("ran");
  const auto result = run({"run", "--backend", "file://" + foreign, "--lock", "job", "--", "touch", marker});
  EXPECT_EQ(result.status, 77) << result.err;
  EXPECT_EQ(run({"inspect", "--backend", "file://" + foreign, "job"}).status, 77);
  EXPECT_FALSE(fs::exists(marker));
  // sudo -E: root with a user's XDG_RUNTIME_DIR and the default backend creates nothing there
  // (the default no longer follows XDG_RUNTIME_DIR: issue 13).
  const auto runtime = path("runtime");
  ASSERT_EQ(mkdir(runtime.c_str(), 0700), 0);
  ASSERT_EQ(chown(runtime.c_str(), nobody, nobody), 0);
  Launch sudo_e;
  sudo_e.env = {{"XDG_RUNTIME_DIR", runtime}, {"TURNSTILE_BACKEND", std::nullopt}};
  const auto as_root = run({"run", "--lock", unique_job(), "--", "true"}, sudo_e);
  EXPECT_EQ(as_root.status, 0) << as_root.err;
  EXPECT_TRUE(fs::is_empty(runtime));
  // The user, in front of a root-owned default directory (made by root for them): 77.
  const auto users_default = "/run/lock/turnstile-" + std::to_string(nobody);
  if (fs::is_directory("/run/lock") && !fs::exists(users_default)) {
    ASSERT_EQ(mkdir(users_default.c_str(), 0700), 0);
    Launch user = sudo_e;
    user.uid = nobody;
    ASSERT_EQ(chmod(dir_.c_str(), 01777), 0);  // where the user's run writes its output
    const auto as_user = run({"run", "--lock", "job", "--", "touch", marker}, user);
    rmdir(users_default.c_str());
    EXPECT_EQ(as_user.status, 77) << as_user.err;
    EXPECT_FALSE(fs::exists(marker));
  }
}

TEST_F(CliTest, CommandNotFoundGives127AndNotExecutableGives126) {
  const auto missing = run({"run", "--backend", backend_, "--lock", "job", "--", "turnstile-no-such-command-xyz"});
  EXPECT_EQ(missing.status, 127) << missing.err;
  EXPECT_NE(missing.err.find("turnstile-no-such-command-xyz"), std::string::npos) << missing.err;
  EXPECT_EQ(run({"run", "--backend", backend_, "--lock", "job", "--", path("nope/cmd")}).status, 127);
  const auto script = path("not-executable");
  write_file(script, "#!/bin/sh\nexit 0\n");
  chmod(script.c_str(), 0644);
  const auto result = run({"run", "--backend", backend_, "--lock", "job", "--", script});
  EXPECT_EQ(result.status, 126) << result.err;
  // The lock was released after the failed exec.
  EXPECT_EQ(run(lock_sh("job", "exit 0", {"--timeout", "0"})).status, 0);
}

// --- the child's environment ------------------------------------------------------------------

TEST_F(CliTest, ChildSeesFencingTokenAndNameAndTokensIncrease) {
  const auto out = path("env");
  const std::string script = "echo \"$TURNSTILE_FENCING_TOKEN $TURNSTILE_NAME\" >> " + out;
  ASSERT_EQ(run(lock_sh("jobs/nightly", script)).status, 0);
  ASSERT_EQ(run(lock_sh("jobs/nightly", script)).status, 0);
  std::istringstream lines(read_file(out));
  std::uint64_t first = 0, second = 0;
  std::string name1, name2;
  lines >> first >> name1 >> second >> name2;
  EXPECT_GT(first, 0u);
  EXPECT_GT(second, first);
  EXPECT_EQ(name1, "jobs/nightly");
  EXPECT_EQ(name2, "jobs/nightly");
  // The read, write and semaphore forms set them too.
  for (const auto& form : std::vector<std::vector<std::string>>{
           {"--read", "rw"}, {"--write", "rw"}, {"--semaphore", "pool", "--limit", "2"}}) {
    std::vector<std::string> args{"run", "--backend", backend_};
    args.insert(args.end(), form.begin(), form.end());
    args.insert(args.end(),
                {"--", "sh", "-c", "test -n \"$TURNSTILE_FENCING_TOKEN\" && test \"$TURNSTILE_NAME\" = " + form[1]});
    EXPECT_EQ(run(args).status, 0) << form[0];
  }
}

// The command gets exactly the descriptors turnstile was given (0, 1, 2 here): nothing the
// library or turnstile opened.
TEST_F(CliTest, ChildInheritsOnlyTheStandardDescriptors) {
  const auto listing = path("fds");
  const auto result =
      run({"run", "--backend", backend_, "--lock", "job", "--", TURNSTILE_PROBE_CHILD_PATH, "fds", listing});
  ASSERT_EQ(result.status, 0) << result.err;
  EXPECT_EQ(listed_descriptors(listing), (std::vector<int>{0, 1, 2})) << read_file(listing);
}

TEST_F(CliTest, ChildInheritsNoLockDescriptors) {
  const auto listing = path("fds"), parent_listing = path("parent-fds");
  ASSERT_EQ(run(lock_sh("job", "ls -l /proc/$PPID/fd > " + parent_listing + "; ls -l /proc/$$/fd > " + listing)).status,
            0);
  // turnstile itself has the backend's files open while the child runs...
  EXPECT_NE(read_file(parent_listing).find(backend_dir_), std::string::npos) << read_file(parent_listing);
  // ...and the child has none of them.
  const auto fds = read_file(listing);
  ASSERT_FALSE(fds.empty());
  EXPECT_EQ(fds.find(backend_dir_), std::string::npos) << fds;
  EXPECT_EQ(fds.find("anon_inode"), std::string::npos) << fds;  // signalfd, eventfd
  EXPECT_EQ(fds.find("pipe:"), std::string::npos) << fds;       // the exec-error pipe
}

// --- exclusion ----------------------------------------------------------------------------------

TEST_F(CliTest, ConcurrentLockRunsNeverOverlap) {
  const auto history = path("history");
  std::vector<Process> runs;
  for (int i = 0; i < 5; ++i) {
    runs.push_back(start({"run", "--backend", backend_, "--lock", "shared/job", "--", TURNSTILE_HOLD_CHILD_PATH,
                          history, "exclusive", "1", "50"}));
  }
  for (auto& process : runs) EXPECT_EQ(wait_exit(process), 0) << process.err();
  const auto records = turnstile::testing::load_history(history);
  EXPECT_EQ(records.size(), 5u);
  const auto violations = turnstile::testing::check(records);
  EXPECT_TRUE(violations.empty()) << turnstile::testing::describe(violations);
  EXPECT_EQ(turnstile::testing::max_concurrency(records), 1);
}

TEST_F(CliTest, ConcurrentSemaphoreRunsRespectTheLimit) {
  const auto history = path("history");
  std::vector<Process> runs;
  for (int i = 0; i < 6; ++i) {
    runs.push_back(start({"run", "--backend", backend_, "--semaphore", "pool", "--limit", "2", "--",
                          TURNSTILE_HOLD_CHILD_PATH, history, "lease", "1", "80"}));
  }
  for (auto& process : runs) EXPECT_EQ(wait_exit(process), 0) << process.err();
  const auto records = turnstile::testing::load_history(history);
  EXPECT_EQ(records.size(), 6u);
  const auto violations = turnstile::testing::check(records, 2);
  EXPECT_TRUE(violations.empty()) << turnstile::testing::describe(violations);
  EXPECT_LE(turnstile::testing::max_concurrency(records), 2);
}

TEST_F(CliTest, ReadersShareAndWriterExcludes) {
  const auto history = path("history");
  std::vector<Process> runs;
  for (int i = 0; i < 6; ++i) {
    const bool writer = i % 3 == 0;
    runs.push_back(start({"run", "--backend", backend_, writer ? "--write" : "--read", "catalog", "--",
                          TURNSTILE_HOLD_CHILD_PATH, history, writer ? "exclusive" : "shared", "1", "50"}));
  }
  for (auto& process : runs) EXPECT_EQ(wait_exit(process), 0) << process.err();
  const auto records = turnstile::testing::load_history(history);
  EXPECT_EQ(records.size(), 6u);
  const auto violations = turnstile::testing::check(records);
  EXPECT_TRUE(violations.empty()) << turnstile::testing::describe(violations);
}

// --- signals ----------------------------------------------------------------------------------

class CliSignalTest : public CliTest, public ::testing::WithParamInterface<int> {};

TEST_P(CliSignalTest, ForwardedToTheChild) {
  const int sig = GetParam();
  const std::string sig_name = sig == SIGINT ? "INT" : sig == SIGTERM ? "TERM" : "HUP";
  const auto ready = path("ready"), marker = path("marker");
  auto process = start(lock_sh("job", "trap 'echo got > " + marker + "; exit 3' " + sig_name + "; touch " + ready +
                                          "; while :; do sleep 0.02; done"));
  ASSERT_TRUE(wait_until([&] { return fs::exists(ready); })) << process.err();
  kill(process.pid, sig);
  EXPECT_EQ(wait_exit(process), 3) << process.err();
  EXPECT_EQ(read_file(marker), "got\n");
}

TEST_P(CliSignalTest, BeforeAcquisitionExitsWithoutRunning) {
  const int sig = GetParam();
  const auto ready = path("ready"), release = path("release"), marker = path("ran");
  auto holder = hold_until("job", ready, release);
  auto waiter = start(lock_sh("job", "touch " + marker));
  ASSERT_TRUE(wait_until([&] { return waiter_count_is("job", 1); })) << waiter.err();
  kill(waiter.pid, sig);
  EXPECT_EQ(wait_exit(waiter), 128 + sig) << waiter.err();
  EXPECT_TRUE(waiter_count_is("job", 0)) << "the waiter left its entry behind";
  EXPECT_NE(waiter.err().find("left the queue of 'job'"), std::string::npos) << waiter.err();  // confirmed
  write_file(release, "");
  EXPECT_EQ(wait_exit(holder), 0);
  EXPECT_FALSE(fs::exists(marker));
  // The abandoned waiter left no trace that blocks the next one.
  EXPECT_EQ(run(lock_sh("job", "exit 0", {"--timeout", "10"})).status, 0);
}

// A signal that came before the command started, here during the first, uncontended try (it is
// pending when turnstile starts), means the command is not run either: the hold taken meanwhile
// is given back and turnstile exits 128 + signal.
TEST_P(CliSignalTest, DuringTheFirstTryExitsWithoutRunning) {
  const int sig = GetParam();
  const auto marker = path("ran");
  Launch pending;
  pending.blocked_signal = sig;
  pending.signal_pending = true;
  // touch, unlike sh, keeps the blocked signal blocked: had it started, it would finish.
  const auto result = run({"run", "--backend", backend_, "--lock", "job", "--", "touch", marker}, pending);
  EXPECT_EQ(result.status, 128 + sig) << result.err;
  EXPECT_FALSE(fs::exists(marker)) << "the command ran although the signal came before it started";
  EXPECT_NE(result.err.find("released 'job'"), std::string::npos) << result.err;
  EXPECT_EQ(run(lock_sh("job", "exit 0", {"--timeout", "0"})).status, 0) << "the hold was not given back";
}

// `turnstile hold` lets go on SIGINT, SIGTERM or SIGHUP and exits 0 (stdin is /dev/null here:
// not its end).
TEST_P(CliSignalTest, HoldReleasesOnTheSignal) {
  const int sig = GetParam();
  auto holder = start({"hold", "--backend", backend_, "job"});
  ASSERT_TRUE(wait_until([&] { return !holder.out().empty(); })) << holder.err();
  EXPECT_EQ(run(lock_sh("job", "true", {"--timeout", "0"})).status, 75);
  kill(holder.pid, sig);
  EXPECT_EQ(wait_exit(holder), 0) << holder.err();
  EXPECT_EQ(run(lock_sh("job", "true", {"--timeout", "0"})).status, 0) << "not released";
}

// A signal while `hold` waits: it leaves the queue, prints no token, exits 128 + signal.
TEST_P(CliSignalTest, HoldInterruptedWhileWaitingPrintsNothing) {
  const int sig = GetParam();
  const auto ready = path("ready"), release = path("release");
  auto holder = hold_until("job", ready, release);
  auto waiter = start({"hold", "--backend", backend_, "job"});
  ASSERT_TRUE(wait_until([&] { return waiter_count_is("job", 1); })) << waiter.err();
  kill(waiter.pid, sig);
  EXPECT_EQ(wait_exit(waiter), 128 + sig) << waiter.err();
  EXPECT_EQ(waiter.out(), "");
  EXPECT_TRUE(waiter_count_is("job", 0));
  write_file(release, "");
  EXPECT_EQ(wait_exit(holder), 0);
}

INSTANTIATE_TEST_SUITE_P(Signals, CliSignalTest, ::testing::Values(SIGINT, SIGTERM, SIGHUP),
                         [](const auto& param_info) { return std::string(sigabbrev_np(param_info.param)); });

// --- loss and death ---------------------------------------------------------------------------

TEST_F(CliTest, LostHoldStopsTheChildAndGives70) {
  const auto ready = path("ready"), marker = path("marker");
  auto process = start(lock_sh(
      "job", "trap 'echo term > " + marker + "; exit 0' TERM; touch " + ready + "; while :; do sleep 0.02; done"));
  ASSERT_TRUE(wait_until([&] { return fs::exists(ready); })) << process.err();
  fs::remove_all(backend_dir_);  // the embedded backend's state is gone: the hold may be lost
  EXPECT_EQ(wait_exit(process), 70) << process.err();
  EXPECT_EQ(read_file(marker), "term\n");
  EXPECT_NE(process.err().find("lost"), std::string::npos) << process.err();
}

TEST_F(CliTest, LostHoldKillsAChildIgnoringSigtermAfterGrace) {
  const auto ready = path("ready");
  auto process =
      start(lock_sh("job", "trap '' TERM; touch " + ready + "; while :; do sleep 0.02; done", {"--grace", "0.2"}));
  ASSERT_TRUE(wait_until([&] { return fs::exists(ready); })) << process.err();
  fs::remove_all(backend_dir_);
  EXPECT_EQ(wait_exit(process), 70) << process.err();
}

// The default --grace (5 s) is longer than a network backend's safety margin: on loss, SIGKILL
// follows SIGTERM within half of it, at most 0.5 s when turnstile does not know the TTL (as
// here), and turnstile exits at most a second after that.
TEST_F(CliTest, LossCutsTheGraceOfACommandIgnoringSigterm) {
  const auto log = path("beats");
  auto process = start({"run", "--backend", backend_, "--lock", "job", "--", TURNSTILE_PROBE_CHILD_PATH, "beat", log});
  ASSERT_TRUE(wait_until([&] { return !read_beats(log).beats.empty(); })) << process.err();
  fs::remove_all(backend_dir_);
  int status = 0;
  ASSERT_TRUE(wait_until([&] { return waitpid(process.pid, &status, WNOHANG) == process.pid; }, 30s)) << process.err();
  const auto exited_ns = turnstile::testing::monotonic_ns();
  std::erase(started_, process.pid);
  EXPECT_EQ(shell_status(status), 70) << process.err();
  const auto beats = read_beats(log);
  ASSERT_NE(beats.term, 0u) << process.err();
  // 0.5 s and 1.5 s, plus room for scheduling.
  EXPECT_LT(beats.last() - beats.term, std::uint64_t{800'000'000}) << "SIGKILL came only after the full --grace";
  EXPECT_LT(exited_ns - beats.term, std::uint64_t{2'000'000'000}) << "turnstile lingered after the loss";
}

// CPU time a process has used itself (its threads, not its children), in clock ticks.
std::uint64_t own_cpu_ticks(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::istringstream fields(text.substr(text.rfind(')') + 2));  // "PID (COMM) STATE ...": COMM may hold ") "
  std::vector<std::string> after_comm{std::istream_iterator<std::string>(fields), {}};
  if (after_comm.size() < 13) return 0;
  return std::stoull(after_comm[11]) + std::stoull(after_comm[12]);  // utime, stime: fields 14 and 15
}

// After a loss turnstile waits for the command's group to go (here until SIGKILL, 0.5 s after
// SIGTERM) without spinning. It did spin: the loss's eventfd stays readable, and polling it
// again returned at once, some 9,000 times a second. Its own CPU time over 300 ms of that wait
// must stay near nothing (a spin costs a whole core, or its share of one).
TEST_F(CliTest, LostHoldWaitsForTheGroupWithoutSpinning) {
  const auto log = path("beats");
  auto process = start({"run", "--backend", backend_, "--lock", "job", "--", TURNSTILE_PROBE_CHILD_PATH, "beat", log});
  ASSERT_TRUE(wait_until([&] { return !read_beats(log).beats.empty(); })) << process.err();
  fs::remove_all(backend_dir_);
  ASSERT_TRUE(wait_until([&] { return read_beats(log).term != 0; })) << process.err();
  const auto before = own_cpu_ticks(process.pid);
  std::this_thread::sleep_for(300ms);
  const auto used = own_cpu_ticks(process.pid) - before;
  EXPECT_LE(used * 1000 / static_cast<std::uint64_t>(sysconf(_SC_CLK_TCK)), 40u)
      << "ms of CPU in 300 ms of waiting for the group after the loss";
  EXPECT_EQ(wait_exit(process), 70) << process.err();
}

// A stopped turnstile (SIGSTOP) is a stopped protector: its watcher stops the command's group
// too, and turnstile continues it when it is continued.
TEST_F(CliTest, StoppingTurnstileStopsTheCommand) {
  const auto log = path("beats");
  auto process = start({"run", "--backend", backend_, "--lock", "job", "--", TURNSTILE_PROBE_CHILD_PATH, "beat", log});
  ASSERT_TRUE(wait_until([&] { return !read_beats(log).beats.empty(); })) << process.err();
  kill(process.pid, SIGSTOP);
  const auto quiet = [&] {
    const auto before = read_beats(log).last();
    std::this_thread::sleep_for(300ms);
    return read_beats(log).last() == before;
  };
  EXPECT_TRUE(wait_until(quiet, 10s)) << "the command ran on while turnstile was stopped";
  const auto stopped_at = read_beats(log).last();
  kill(process.pid, SIGCONT);
  EXPECT_TRUE(wait_until([&] { return read_beats(log).last() > stopped_at; }, 10s)) << "the command was not continued";
  kill(process.pid, SIGINT);
  EXPECT_EQ(wait_exit(process), 0) << process.err();
}

TEST_F(CliTest, ChildDiesWhenTurnstileIsKilled) {
  const auto pid_file = path("child-pid");
  auto process = start(lock_sh("job", "echo $$ > " + pid_file + "; exec sleep 600"));
  ASSERT_TRUE(wait_until([&] { return !read_file(pid_file).empty(); })) << process.err();
  const pid_t child = std::stoi(read_file(pid_file));
  kill(process.pid, SIGKILL);
  EXPECT_EQ(wait_exit(process), 128 + SIGKILL);
  // We are the subreaper: the orphaned child comes to us, and must die of PDEATHSIG.
  int status = 0;
  ASSERT_TRUE(wait_until([&] { return waitpid(child, &status, WNOHANG) == child; })) << "the child outlived turnstile";
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  // And the lock is free: the kernel dropped turnstile's hold.
  EXPECT_EQ(run(lock_sh("job", "exit 0", {"--timeout", "10"})).status, 0);
}

// --- the command's process group --------------------------------------------------------------

// `sh -c 'sleep 600 & ...; wait'`: the sleep is the command's own subprocess. Returns its pid.
pid_t started_subprocess(const std::string& pid_file) {
  EXPECT_TRUE(wait_until([&] { return read_number(pid_file) != 0; })) << "the command never started its subprocess";
  return static_cast<pid_t>(read_number(pid_file));
}

constexpr auto kDies = 10s;  // a killed process is gone well within this

TEST_F(CliTest, TheCommandsSubprocessesDieWhenTurnstileIsKilled) {
  const auto pid_file = path("sleep-pid");
  auto process = start(lock_sh("job", "sleep 600 & echo $! > " + pid_file + "; wait"));
  const pid_t sleeper = started_subprocess(pid_file);
  ASSERT_GT(sleeper, 0);
  kill(process.pid, SIGKILL);
  EXPECT_EQ(wait_exit(process), 128 + SIGKILL);
  EXPECT_TRUE(wait_until([&] { return gone(sleeper); }, kDies)) << "the command's subprocess outlived turnstile";
  EXPECT_EQ(run(lock_sh("job", "exit 0", {"--timeout", "10"})).status, 0);
}

// Red team (issue 24, F3): a watcher killed first (`pkill -9 turnstile` kills it too) left the
// command unprotected without a word. turnstile says so when it reaps its watcher.
TEST_F(CliTest, AKilledWatcherIsToldOnStderr) {
  const auto pid_file = path("sleep-pid");
  auto process = start(lock_sh("job", "sleep 600 & echo $! > " + pid_file + "; wait"));
  ASSERT_GT(started_subprocess(pid_file), 0);
  // turnstile's children: the command (its group's leader) and the watcher, in a session of its own.
  pid_t watcher = 0;
  std::ifstream children("/proc/" + std::to_string(process.pid) + "/task/" + std::to_string(process.pid) + "/children");
  for (pid_t child = 0; children >> child;) {
    if (getsid(child) == child && getpgid(child) == child && getsid(child) != getsid(process.pid)) watcher = child;
  }
  ASSERT_GT(watcher, 0) << "no watcher among turnstile's children";
  kill(watcher, SIGKILL);
  EXPECT_TRUE(wait_until([&] { return process.err().find("its watcher (pid ") != std::string::npos; }))
      << process.err();
  kill(process.pid, SIGTERM);
  EXPECT_EQ(wait_exit(process), 128 + SIGTERM) << process.err();
}

TEST_F(CliTest, LostHoldStopsTheWholeGroup) {
  const auto pid_file = path("sleep-pid");
  auto process = start(lock_sh("job", "sleep 600 & echo $! > " + pid_file + "; wait"));
  const pid_t sleeper = started_subprocess(pid_file);
  fs::remove_all(backend_dir_);
  EXPECT_EQ(wait_exit(process), 70) << process.err();
  EXPECT_TRUE(wait_until([&] { return gone(sleeper); }, kDies)) << "the command's subprocess outlived the hold";
}

TEST_F(CliTest, ForwardedSignalReachesTheWholeGroup) {
  const auto pid_file = path("sleep-pid");
  auto process = start(lock_sh("job", "sleep 600 & echo $! > " + pid_file + "; wait"));
  const pid_t sleeper = started_subprocess(pid_file);
  kill(process.pid, SIGTERM);
  EXPECT_EQ(wait_exit(process), 128 + SIGTERM) << process.err();
  EXPECT_TRUE(wait_until([&] { return gone(sleeper); }, kDies)) << "the signal did not reach the subprocess";
}

TEST_F(CliTest, LeftoversOfTheCommandAreStoppedBeforeTheRelease) {
  const auto pid_file = path("sleep-pid");
  const auto result = run(lock_sh("job", "sleep 600 & echo $! > " + pid_file));
  EXPECT_EQ(result.status, 0) << result.err;
  EXPECT_NE(result.err.find("left processes"), std::string::npos) << result.err;
  const pid_t sleeper = static_cast<pid_t>(read_number(pid_file));
  ASSERT_GT(sleeper, 0);
  EXPECT_TRUE(gone(sleeper)) << "a subprocess of the command ran on after the release";
}

// `kill -INT -PGID`, `timeout 1 turnstile run ...`, systemd: a signal sent to turnstile's whole
// process group reaches the command once (through turnstile), not twice.
TEST_F(CliTest, GroupSignalReachesTheCommandOnce) {
  const auto ready = path("ready"), log = path("log");
  Launch job;
  job.own_group = true;
  auto process = start(
      {"run", "--backend", backend_, "--lock", "job", "--", TURNSTILE_PROBE_CHILD_PATH, "count-signals", ready, log},
      job);
  ASSERT_TRUE(wait_until([&] { return fs::exists(ready); })) << process.err();
  kill(-process.pid, SIGINT);
  ASSERT_TRUE(wait_until([&] { return !read_file(log).empty(); })) << process.err();
  std::this_thread::sleep_for(300ms);  // room for a second delivery to show
  kill(-process.pid, SIGTERM);
  EXPECT_EQ(wait_exit(process), 0) << process.err();
  EXPECT_EQ(read_file(log), "INT\nTERM\n");
}

// --- inspect ------------------------------------------------------------------------------------

// Peer data (here the host name, as the embedded backend reports it) may hold terminal escapes
// and bytes that are not UTF-8: the table shows them escaped, JSON stays valid.
TEST_F(CliTest, InspectEscapesHostileHostNames) {
  const auto ready = path("ready"), release = path("release");
  auto holder = hold_until("job", ready, release);
  Launch hostile;
  hostile.prefix = {TURNSTILE_PROBE_CHILD_PATH, "hostname", "a\\e[2Jb\\xffc\\xc2\\x9bd"};
  const auto table = run({"inspect", "--backend", backend_, "job"}, hostile);
  if (table.status == 77) GTEST_SKIP() << "no UTS namespace here: " << table.err;
  EXPECT_EQ(table.status, 0) << table.err;
  EXPECT_EQ(table.out.find('\x1b'), std::string::npos) << table.out;
  EXPECT_EQ(table.out.find('\xff'), std::string::npos) << table.out;
  EXPECT_EQ(table.out.find("\xc2\x9b"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("a\\u{1b}[2Jb\\xffc\\u{9b}d"), std::string::npos) << table.out;
  const auto json = run({"inspect", "--backend", backend_, "--json", "job"}, hostile);
  ASSERT_EQ(json.status, 0) << json.err;
  const auto parsed = nlohmann::json::parse(json.out, nullptr, false);
  ASSERT_FALSE(parsed.is_discarded()) << json.out;
  EXPECT_EQ(parsed["holders"][0]["host"].get<std::string>(),
            "a\x1b[2Jb\xef\xbf\xbd"
            "c\xc2\x9b"
            "d");
  write_file(release, "");
  EXPECT_EQ(wait_exit(holder), 0);
}

// The table's columns line up whatever its cells: LABEL starts at the same character in the
// header and every row, with one host cell carrying "(kept until …)" and a host name of two-byte
// characters (the embedded backend reports the inspecting host's name). The width was counted in
// bytes: the header's LABEL stood one column right of the rows'.
TEST_F(CliTest, InspectLinesUpTheColumnsWhateverTheCells) {
  const std::vector<std::string> lease{"run", "--backend", backend_, "--semaphore", "pool", "--limit", "2"};
  auto kept_args = lease;
  kept_args.insert(kept_args.end(), {"--hold-at-least", "1h", "--holder-label", "kept", "--", "true"});
  const auto kept = run(kept_args);
  ASSERT_EQ(kept.status, 0) << kept.err;
  const auto ready = path("ready"), release = path("release");
  auto held_args = lease;
  held_args.insert(held_args.end(), {"--holder-label", "held", "--", "sh", "-c",
                                     "echo x > " + ready + "; while [ ! -e " + release + " ]; do sleep 0.02; done"});
  auto holder = start(held_args);
  ASSERT_TRUE(wait_until([&] { return fs::exists(ready) && !read_file(ready).empty(); })) << holder.err();

  Launch accented;
  accented.prefix = {TURNSTILE_PROBE_CHILD_PATH, "hostname", "h\xc3\xb4te-\xc3\xa9t\xc3\xa9"};
  const auto table = run({"inspect", "--backend", backend_, "pool"}, accented);
  if (table.status == 77) GTEST_SKIP() << "no UTS namespace here: " << table.err;
  ASSERT_EQ(table.status, 0) << table.err;
  ASSERT_NE(table.out.find("kept until"), std::string::npos) << table.out;
  ASSERT_NE(table.out.find("h\xc3\xb4te-\xc3\xa9t\xc3\xa9"), std::string::npos) << table.out;
  // Where `cell` starts in the line that has it, in characters (UTF-8 sequences count once).
  const auto column_of = [&](const std::string& cell) -> long {
    const auto at = table.out.find(cell);
    if (at == std::string::npos) return -1;
    const auto line_start = table.out.rfind('\n', at) + 1;  // npos + 1 == 0 on the first line
    return std::count_if(table.out.begin() + static_cast<long>(line_start), table.out.begin() + static_cast<long>(at),
                         [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; });
  };
  const auto label = column_of("LABEL");
  EXPECT_GT(label, 0) << table.out;
  EXPECT_EQ(column_of("\"kept\""), label) << table.out;
  EXPECT_EQ(column_of("\"held\""), label) << table.out;
  write_file(release, "");
  EXPECT_EQ(wait_exit(holder), 0);
}

TEST_F(CliTest, InspectShowsHolderAndWaitersInOrder) {
  const auto ready = path("ready"), release = path("release");
  auto holder = hold_until("jobs/report", ready, release);
  const auto token = std::stoull(read_file(ready));

  auto first = start(lock_sh("jobs/report", "exit 0"));
  ASSERT_TRUE(wait_until([&] { return waiter_count_is("jobs/report", 1); }));
  auto second = start(lock_sh("jobs/report", "exit 0"));
  ASSERT_TRUE(wait_until([&] { return waiter_count_is("jobs/report", 2); }));

  const auto q = inspect_json("jobs/report");
  EXPECT_EQ(q["name"], "jobs/report");
  EXPECT_EQ(q["mode"], "lock");
  EXPECT_TRUE(q["permits"].is_null());
  ASSERT_EQ(q["holders"].size(), 1u);
  const auto& h = q["holders"][0];
  EXPECT_EQ(h["fencing_token"].get<std::uint64_t>(), token);
  EXPECT_EQ(h["pid"].get<pid_t>(), holder.pid);  // turnstile holds, on its child's behalf
  EXPECT_EQ(h["kind"], "exclusive");
  EXPECT_EQ(h["permits"], 1);
  EXPECT_FALSE(h["host"].get<std::string>().empty());
  EXPECT_TRUE(h["since"].get<std::string>().ends_with("Z"));
  ASSERT_EQ(q["waiters"].size(), 2u);
  EXPECT_EQ(q["waiters"][0]["pid"].get<pid_t>(), first.pid);
  EXPECT_EQ(q["waiters"][1]["pid"].get<pid_t>(), second.pid);
  EXPECT_LT(q["waiters"][0]["fencing_token"].get<std::uint64_t>(),
            q["waiters"][1]["fencing_token"].get<std::uint64_t>());

  const auto table = run({"inspect", "--backend", backend_, "jobs/report"});
  EXPECT_EQ(table.status, 0);
  EXPECT_NE(table.out.find(std::to_string(holder.pid)), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("waiter"), std::string::npos) << table.out;

  write_file(release, "");
  EXPECT_EQ(wait_exit(holder), 0);
  EXPECT_EQ(wait_exit(first), 0);
  EXPECT_EQ(wait_exit(second), 0);
  const auto idle = inspect_json("jobs/report");
  EXPECT_TRUE(idle["holders"].empty());
  EXPECT_TRUE(idle["waiters"].empty());
}

TEST_F(CliTest, InspectShowsSemaphoreLimit) {
  const auto ready = path("ready"), release = path("release");
  auto holder = start({"run", "--backend", backend_, "--semaphore", "pool", "--limit", "3", "--", "sh", "-c",
                       "touch " + ready + "; while [ ! -e " + release + " ]; do sleep 0.02; done"});
  ASSERT_TRUE(wait_until([&] { return fs::exists(ready); })) << holder.err();
  const auto q = inspect_json("pool");
  EXPECT_EQ(q["mode"], "semaphore");
  EXPECT_EQ(q["limit"], 3);
  ASSERT_EQ(q["holders"].size(), 1u);
  EXPECT_EQ(q["holders"][0]["kind"], "lease");
  write_file(release, "");
  EXPECT_EQ(wait_exit(holder), 0);
}

// inspect names the backend it read, and where that came from; JSON carries its schema's version.
TEST_F(CliTest, InspectNamesTheBackendItReadAndTheSchemaVersion) {
  const auto ready = path("ready"), release = path("release");
  auto holder = hold_until("job", ready, release);
  const auto table = run({"inspect", "--backend", backend_, "job"});
  EXPECT_EQ(table.status, 0) << table.err;
  EXPECT_TRUE(table.out.starts_with("backend  " + backend_ + "\n")) << table.out;
  Launch from_env;
  from_env.env = {{"TURNSTILE_BACKEND", backend_}};
  const auto env_table = run({"inspect", "job"}, from_env);
  EXPECT_TRUE(env_table.out.starts_with("backend  " + backend_ + " (TURNSTILE_BACKEND)\n")) << env_table.out;
  const auto q = inspect_json("job");
  EXPECT_EQ(q["schema_version"], 1);
  EXPECT_EQ(q["backend"], backend_);
  ASSERT_EQ(q["holders"].size(), 1u);
  // Every field docs/inspect-json.md lists, with a turnstile holder's types.
  const auto& h = q["holders"][0];
  for (const char* key : {"fencing_token", "kind", "permits", "pid", "host", "since", "label", "foreign"}) {
    EXPECT_TRUE(h.contains(key)) << key << " missing: " << h.dump();
  }
  EXPECT_TRUE(h["foreign"].is_null());
  EXPECT_TRUE(h["label"].is_null());
  for (const char* key : {"name", "mode", "limit", "permits", "holders", "waiters"}) {
    EXPECT_TRUE(q.contains(key)) << key << " missing: " << q.dump();
  }
  write_file(release, "");
  EXPECT_EQ(wait_exit(holder), 0);
}

// --holder-label is kept by the embedded backend too: inspect shows it and a contender's busy
// message names the holder by it. --ttl, which the embedded backend has no use for, is not
// ignored silently.
TEST_F(CliTest, HolderLabelAndTtlOnTheEmbeddedBackend) {
  Launch pipes;
  pipes.stdin_pipe = pipes.stdout_pipe = true;
  auto holder = start({"hold", "--backend", backend_, "--ttl", "5", "--holder-label", "nightly report", "job"}, pipes);
  ASSERT_FALSE(read_line(holder.stdout_fd).empty()) << holder.err();
  const auto q = inspect_json("job");
  ASSERT_EQ(q["holders"].size(), 1u) << q.dump();
  EXPECT_EQ(q["holders"][0]["label"], "nightly report") << q.dump();
  const auto busy = run({"run", "--backend", backend_, "--timeout", "0", "--lock", "job", "--", "true"});
  EXPECT_EQ(busy.status, 75) << busy.err;
  EXPECT_NE(busy.err.find("is busy; held by \"nightly report\" pid "), std::string::npos) << busy.err;
  close_pipe(holder.stdin_fd);
  EXPECT_EQ(wait_exit(holder), 0) << holder.err();
  EXPECT_NE(holder.err().find("note: --ttl has no effect on file://"), std::string::npos) << holder.err();
  const auto untimed = run({"run", "--backend", backend_, "--lock", "job", "--", "true"});
  EXPECT_EQ(untimed.status, 0) << untimed.err;
  EXPECT_EQ(untimed.err.find("--ttl"), std::string::npos) << untimed.err;
}

// Issue 24 item 4 on file://: the state keeps the released entry until its time; `hold` keeps it
// from when it was taken; a bad DURATION is a usage error that touches nothing.
TEST_F(CliTest, HoldAtLeastRunsTheJobOnceAcrossHosts) { expect_hold_at_least_runs_the_job_once("cron/nightly"); }

TEST_F(CliTest, HoldAtLeastKeepsAHoldAfterHoldLetsGo) {
  Launch pipes;
  pipes.stdin_pipe = pipes.stdout_pipe = true;
  const auto taken = std::chrono::steady_clock::now();
  auto holder = start({"hold", "--backend", backend_, "--hold-at-least", "2500ms", "job"}, pipes);
  ASSERT_FALSE(read_line(holder.stdout_fd).empty()) << holder.err();
  close_pipe(holder.stdin_fd);
  EXPECT_EQ(wait_exit(holder), 0) << holder.err();
  const auto busy = run({"run", "--backend", backend_, "--timeout", "0", "--lock", "job", "--", "true"});
  EXPECT_EQ(busy.status, 75) << busy.err;
  const auto waited = run({"run", "--backend", backend_, "--timeout", "30", "--lock", "job", "--", "true"});
  EXPECT_EQ(waited.status, 0) << waited.err;
  EXPECT_GE(std::chrono::steady_clock::now() - taken, 2500ms);
  for (const std::string bad : {"5x", "-1", "s", "1e10"}) {
    const auto refused = run(lock_sh("other", "true", {"--hold-at-least", bad}));
    EXPECT_EQ(refused.status, 64) << bad << ": " << refused.err;
    EXPECT_NE(refused.err.find("--hold-at-least must be a duration"), std::string::npos) << refused.err;
  }
}

// inspect of a file:// directory that does not exist creates nothing: nobody is queued there.
// Names are still checked as the library checks them, in its words.
TEST_F(CliTest, InspectOfAMissingDirectoryCreatesNothing) {
  const auto missing = dir_ + "/not/there";
  const auto table = run({"inspect", "--backend", "file://" + missing, "job"});
  EXPECT_EQ(table.status, 0) << table.err;
  EXPECT_NE(table.out.find("(nobody queued)"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("does not exist (not created)"), std::string::npos) << table.out;
  const auto json = run({"inspect", "--json", "--backend", "file://" + missing, "job"});
  ASSERT_EQ(json.status, 0) << json.err;
  const auto q = nlohmann::json::parse(json.out);
  EXPECT_EQ(q["backend"], "file://" + missing);
  EXPECT_TRUE(q["holders"].empty() && q["waiters"].empty()) << json.out;
  Launch from_env;
  from_env.env = {{"TURNSTILE_BACKEND", "file://" + missing}};
  EXPECT_EQ(run({"inspect", "job"}, from_env).status, 0);
  EXPECT_FALSE(fs::exists(dir_ + "/not")) << "inspect created the directory";

  // The same refusals, in the same words, whether the directory exists or not.
  const auto existing = path("existing");
  ASSERT_EQ(run({"run", "--backend", "file://" + existing, "--lock", "job", "--", "true"}).status, 0);
  for (const std::string& name :
       std::vector<std::string>{"/a", "a/", "a//b", "a/./b", "a/../b", "a\x01", "a\xff", std::string(256, 'x')}) {
    const auto on_missing = run({"inspect", "--backend", "file://" + missing, name});
    const auto on_existing = run({"inspect", "--backend", "file://" + existing, name});
    EXPECT_EQ(on_missing.status, 64) << on_missing.err;
    EXPECT_EQ(on_existing.status, 64) << on_existing.err;
    EXPECT_EQ(on_missing.err, on_existing.err);
  }
  EXPECT_FALSE(fs::exists(dir_ + "/not")) << "inspect created the directory";
}

std::vector<nlohmann::json> json_lines(const std::string& text) {
  std::vector<nlohmann::json> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    const auto parsed = nlohmann::json::parse(line, nullptr, false);
    if (!parsed.is_discarded()) lines.push_back(parsed);
  }
  return lines;
}

// inspect --watch --json prints one object per change, as holders and waiters come and go (and
// does not create the directory it watches); SIGTERM ends it with 0.
TEST_F(CliTest, InspectWatchShowsEachChange) {
  auto watcher = start({"inspect", "--backend", backend_, "--watch", "--json", "--interval", "0.05", "job"});
  const auto last = [&] {
    const auto lines = json_lines(watcher.out());
    return lines.empty() ? nlohmann::json() : lines.back();
  };
  ASSERT_TRUE(wait_until([&] { return !json_lines(watcher.out()).empty(); })) << watcher.err();
  EXPECT_TRUE(last()["holders"].empty());
  EXPECT_FALSE(fs::exists(backend_dir_)) << "the watch created the directory";

  const auto ready = path("ready"), release = path("release");
  auto holder = hold_until("job", ready, release);
  const auto token = std::stoull(read_file(ready));
  EXPECT_TRUE(wait_until([&] {
    const auto q = last();
    return q.contains("holders") && q["holders"].size() == 1 && q["holders"][0]["fencing_token"] == token;
  })) << watcher.out();
  auto waiter = start(lock_sh("job", "true"));
  EXPECT_TRUE(wait_until([&] { return last().contains("waiters") && last()["waiters"].size() == 1; })) << watcher.out();
  write_file(release, "");
  EXPECT_EQ(wait_exit(holder), 0);
  EXPECT_EQ(wait_exit(waiter), 0);
  EXPECT_TRUE(wait_until([&] { return last()["holders"].empty() && last()["waiters"].empty(); })) << watcher.out();

  const auto lines = json_lines(watcher.out());
  for (std::size_t i = 1; i < lines.size(); ++i) EXPECT_NE(lines[i], lines[i - 1]) << "printed without a change";
  kill(watcher.pid, SIGTERM);
  EXPECT_EQ(wait_exit(watcher), 0) << watcher.err();
}

// The table form redraws too (not on a terminal: each view after a blank line); SIGINT ends it.
TEST_F(CliTest, InspectWatchRedrawsTheTable) {
  auto watcher = start({"inspect", "--backend", backend_, "--watch", "--interval", "0.05", "job"});
  ASSERT_TRUE(wait_until([&] { return watcher.out().find("(nobody queued)") != std::string::npos; })) << watcher.err();
  const auto ready = path("ready"), release = path("release");
  auto holder = hold_until("job", ready, release);
  EXPECT_TRUE(wait_until([&] { return watcher.out().find("holder ") != std::string::npos; })) << watcher.out();
  EXPECT_NE(watcher.out().find("\n\nbackend  " + backend_), std::string::npos) << watcher.out();
  kill(watcher.pid, SIGINT);
  EXPECT_EQ(wait_exit(watcher), 0) << watcher.err();
  write_file(release, "");
  EXPECT_EQ(wait_exit(holder), 0);
}

// --- demo ----------------------------------------------------------------------------------------

TEST_F(CliTest, ParkingDemoRunsSound) {
  const auto result = run({"demo", "parking", "--cars", "6", "--spaces", "2"});
  EXPECT_EQ(result.status, 0) << result.out << result.err;
  EXPECT_NE(result.out.find("history sound"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("of 2 spaces used"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("parks in space"), std::string::npos) << result.out;
}

TEST_F(CliTest, ParkingDemoOnAGivenBackend) {
  const auto result = run({"demo", "parking", "--cars", "3", "--spaces", "1", "--backend", backend_});
  EXPECT_EQ(result.status, 0) << result.out << result.err;
  EXPECT_TRUE(fs::exists(backend_dir_));
  const auto bad = run({"demo", "parking", "--backend", "nosuch://x"});
  EXPECT_EQ(bad.status, 64) << bad.err;
}

// file:// elections: `turnstile elect NAME -- CMD` runs CMD while leader, with its value and
// token in CMD's environment; `turnstile leader` prints the value (JSON: token too, and `since`
// in ISO-8601, as its help says) and exits 1 once the leader resigned; a lock on the election's
// name is a kind mismatch (64); kill -9 of a leader lets the next candidate lead at once (the
// kernel drops the leader's lock bytes).
TEST_F(CliTest, ElectAndLeaderOnTheEmbeddedBackend) {
  const auto seen = path("seen");
  auto elected = start({"elect", "--backend", backend_, "--value", "alpha", "jobs/e", "--", "sh", "-c",
                        "echo \"$TURNSTILE_LEADER_VALUE $TURNSTILE_FENCING_TOKEN\" > " + seen + "; exec sleep 30"});
  ASSERT_TRUE(wait_until([&] { return !read_file(seen).empty(); })) << elected.err();
  const auto line = read_file(seen);
  ASSERT_EQ(line.rfind("alpha ", 0), 0u) << line;
  const auto token = std::stoull(line.substr(6));
  const auto text = run({"leader", "--backend", backend_, "jobs/e"});
  EXPECT_EQ(text.status, 0) << text.err;
  EXPECT_EQ(text.out, "alpha\n");
  const auto json = nlohmann::json::parse(run({"leader", "--backend", backend_, "--json", "jobs/e"}).out);
  EXPECT_EQ(json["value"], "alpha") << json.dump();
  EXPECT_EQ(json["fencing_token"].get<std::uint64_t>(), token) << json.dump();
  // `since` is printed as ISO-8601 in UTC (2026-11-27T16:04:40.123Z), and the help says so.
  ASSERT_TRUE(json["since"].is_string()) << json.dump();
  const auto since = json["since"].get<std::string>();
  EXPECT_TRUE(since.size() == 24 && since[10] == 'T' && since.back() == 'Z') << since;
  const auto help = run({"leader", "--help"}).out;
  EXPECT_NE(help.find("since: ISO-8601"), std::string::npos) << help;
  EXPECT_EQ(help.find("since the epoch"), std::string::npos) << help;
  EXPECT_EQ(inspect_json("jobs/e")["holders"][0]["value"], "alpha");
  EXPECT_EQ(run({"elect", "--backend", backend_, "--timeout", "0", "jobs/e", "--", "true"}).status, 75);
  EXPECT_EQ(run({"run", "--backend", backend_, "--timeout", "0", "--lock", "jobs/e", "--", "true"}).status, 64)
      << "a lock on an election's name must be a kind mismatch";
  kill(elected.pid, SIGKILL);
  EXPECT_EQ(wait_exit(elected), 128 + SIGKILL);
  const auto next = run({"elect", "--backend", backend_, "--timeout", "10", "--value", "next", "jobs/e", "--", "true"});
  EXPECT_EQ(next.status, 0) << next.err;
  const auto none = run({"leader", "--backend", backend_, "jobs/e"});
  EXPECT_EQ(none.status, 1) << none.err;
  EXPECT_EQ(none.out, "");
  EXPECT_EQ(run({"elect", "--backend", backend_, "jobs/e"}).status, 64) << "no command";
}

// `turnstile leader --watch` prints the leader now, then each change, woken by file events.
TEST_F(CliTest, LeaderWatchOnTheEmbeddedBackend) {
  Launch pipes;
  pipes.stdout_pipe = true;
  auto watcher = start({"leader", "--backend", backend_, "--watch", "jobs/w"}, pipes);
  EXPECT_EQ(read_line(watcher.stdout_fd), "(no leader)") << watcher.err();
  const auto elected = run({"elect", "--backend", backend_, "--value", "one", "jobs/w", "--", "sleep", "0.2"});
  EXPECT_EQ(elected.status, 0) << elected.err;
  EXPECT_EQ(read_line(watcher.stdout_fd), "one");
  EXPECT_EQ(read_line(watcher.stdout_fd), "(no leader)");
  kill(watcher.pid, SIGINT);
  EXPECT_EQ(wait_exit(watcher), 0) << watcher.err();
}

}  // namespace
