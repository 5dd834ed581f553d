// SPDX-License-Identifier: Apache-2.0
// Connecting (issue 24 items 7 and 8), without any server: a port that refuses every
// connection is a definite answer on zk:// and etcd:// too (they took 10 s to say so), a server
// that accepts and then says nothing is not, and a signal while connecting ends `turnstile run`
// and `turnstile hold` at once with 128 + N on every network backend (it was ignored until the
// connect gave up).
#include <tuple>

#include "cli_support.hpp"
#include "support/local_port.hpp"

namespace {

using namespace cli_tests;
using Clock = std::chrono::steady_clock;

using turnstile_test::LocalPort;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

bool not_installed(const std::string& err) { return err.find("is not installed") != std::string::npos; }

// --- item 7: a refusal by every listed server is a definite answer ---------------------------

class RefusedConnect : public CliTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(RefusedConnect, EveryServerRefusingFailsAtOnceSayingSo) {
  LocalPort first(false), second(false);
  for (const auto& servers : {first.address(), first.address() + "," + second.address()}) {
    const auto url = GetParam() + "://" + servers;
    const auto start = Clock::now();
    const auto result = run({"run", "--backend", url, "--lock", "job", "--", "true"});
    const double took = seconds_since(start);
    if (not_installed(result.err)) GTEST_SKIP() << result.err;
    EXPECT_EQ(result.status, 69) << result.err;
    EXPECT_NE(result.err.find("connection refused"), std::string::npos) << result.err;
    // It took 10 s (the whole connect timeout). Fast means well under a second; the bound is
    // generous for a loaded machine.
    EXPECT_LT(took, 2.0) << url << ": " << result.err;
    std::printf("%s: refused after %.3f s\n", url.c_str(), took);
  }
}

// A server that accepts and then says nothing might still answer: the connect waits its whole
// timeout, though the other listed server refuses.
TEST_P(RefusedConnect, AnAcceptingServerIsNotARefusal) {
  LocalPort refusing(false), silent(true);
  const auto url = GetParam() + "://" + refusing.address() + "," + silent.address();
  const auto start = Clock::now();
  const auto result = run({"run", "--backend", url, "--connect-timeout", "1.5", "--lock", "job", "--", "true"});
  const double took = seconds_since(start);
  if (not_installed(result.err)) GTEST_SKIP() << result.err;
  EXPECT_EQ(result.status, 69) << result.err;
  EXPECT_EQ(result.err.find("connection refused"), std::string::npos) << result.err;
  EXPECT_GE(took, 1.4) << "gave up before the connect timeout: " << result.err;
}

INSTANTIATE_TEST_SUITE_P(Backends, RefusedConnect, ::testing::Values("zk", "etcd"));

// --- item 8: a signal while connecting ends turnstile at once --------------------------------

using SignalCase = std::tuple<std::string, std::string, int>;  // scheme, command, signal

class SignalWhileConnecting : public CliTest, public ::testing::WithParamInterface<SignalCase> {};

TEST_P(SignalWhileConnecting, ExitsAtOnceWith128PlusTheSignal) {
  const auto& [scheme, command, sig] = GetParam();
  LocalPort silent(true);
  const auto url = scheme + "://" + silent.address();
  const auto ran = path("ran");
  std::vector<std::string> args{command, "--backend", url, "--lock", "job"};
  if (command == "run") args.insert(args.end(), {"--", "touch", ran});
  auto turnstile = start(args);
  // Really connecting: its connection reached the server, which will never answer it.
  const bool connecting = wait_until([&] { return silent.take_connection() || gone(turnstile.pid); });
  if (not_installed(turnstile.err())) GTEST_SKIP() << turnstile.err();
  ASSERT_TRUE(connecting && !gone(turnstile.pid)) << turnstile.err();
  const auto signalled = Clock::now();
  kill(turnstile.pid, sig);
  // Without the fix it waited the whole connect timeout (10 s), then exited 69.
  EXPECT_EQ(wait_exit(turnstile, std::chrono::seconds(5)), 128 + sig) << turnstile.err();
  const double took = seconds_since(signalled);
  EXPECT_LT(took, 2.0) << turnstile.err();
  EXPECT_NE(turnstile.err().find("while connecting"), std::string::npos) << turnstile.err();
  EXPECT_FALSE(fs::exists(ran));
  std::printf("%s %s, signal %d: exited %.3f s after it\n", url.c_str(), command.c_str(), sig, took);
}

std::string signal_case_name(const ::testing::TestParamInfo<SignalCase>& info) {
  const auto& [scheme, command, sig] = info.param;
  return scheme + "_" + command + "_" + std::to_string(sig);
}

INSTANTIATE_TEST_SUITE_P(Backends, SignalWhileConnecting,
                         ::testing::Combine(::testing::Values("redis", "zk", "etcd", "consul"),
                                            ::testing::Values("run", "hold"),
                                            ::testing::Values(SIGINT, SIGTERM, SIGHUP)),
                         signal_case_name);

// --- credentials in turnstile's own arguments ----------------------------------------------

// Any user of the host reads /proc/PID/cmdline (ps): a --backend URL's password or token was
// there for the whole run, in turnstile's and in its watcher's arguments. Checked while the
// connect hangs on a server that never answers (both forms of the option, both secret forms).
TEST_F(CliTest, CredentialsInABackendUrlAreHiddenFromOtherUsers) {
  for (const auto& [option, url_of] : std::vector<std::pair<std::string, std::string>>{
           {"--backend", "redis://user:s3cr3t-pass@"}, {"--backend=", "consul://s3cr3t-pass@"}}) {
    LocalPort silent(true);
    const auto url = url_of + silent.address();
    std::vector<std::string> args{"hold", "--connect-timeout", "5", "--lock", "job"};
    if (option == "--backend") {
      args.insert(args.begin() + 1, {"--backend", url});
    } else {
      args.insert(args.begin() + 1, "--backend=" + url);
    }
    auto turnstile = start(args);
    const bool connecting = wait_until([&] { return silent.take_connection() || gone(turnstile.pid); });
    if (not_installed(turnstile.err())) GTEST_SKIP() << turnstile.err();
    ASSERT_TRUE(connecting && !gone(turnstile.pid)) << turnstile.err();
    auto shown = read_file("/proc/" + std::to_string(turnstile.pid) + "/cmdline");
    std::replace(shown.begin(), shown.end(), '\0', ' ');
    EXPECT_EQ(shown.find("s3cr3t"), std::string::npos) << shown;
    EXPECT_NE(shown.find(silent.address()), std::string::npos) << shown;  // the rest stays readable
    kill(turnstile.pid, SIGTERM);
    EXPECT_EQ(wait_exit(turnstile, std::chrono::seconds(5)), 128 + SIGTERM) << turnstile.err();
  }
}

}  // namespace
