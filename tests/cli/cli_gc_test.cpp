// SPDX-License-Identifier: Apache-2.0
// `turnstile gc` and the state a `turnstile run` leaves (issue 24 item 1): a run removes its
// name's state file as it exits; gc removes what a killed run left, never a name in use.
#include "cli_support.hpp"

namespace {

using namespace cli_tests;

std::vector<std::string> state_files(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST_F(CliTest, ARunLeavesNoStateFileBehind) {
  for (int i = 0; i < 3; ++i) {
    const auto result = run(lock_sh("deploy/build-" + std::to_string(i), "true"));
    ASSERT_EQ(result.status, 0) << result.err;
  }
  EXPECT_TRUE(state_files(backend_dir_).empty());
}

TEST_F(CliTest, GcRemovesWhatAKilledRunLeftAndNeverANameInUse) {
  // One run killed with SIGKILL while it holds (its watcher ends the command): its file stays.
  auto killed = hold_until("deploy/killed", path("killed.ready"), path("never"));
  kill(killed.pid, SIGKILL);
  wait_exit(killed);
  // One still holding.
  auto holder = hold_until("deploy/held", path("held.ready"), path("held.release"));
  ASSERT_EQ(state_files(backend_dir_), (std::vector<std::string>{"n.deploy%2Fheld.s", "n.deploy%2Fkilled.s"}));

  const auto other_prefix = run({"gc", "--backend", backend_, "jobs/"});
  EXPECT_EQ(other_prefix.status, 0) << other_prefix.err;
  EXPECT_EQ(other_prefix.out, "");
  const auto gc = run({"gc", "--backend", backend_});
  EXPECT_EQ(gc.status, 0) << gc.err;
  EXPECT_EQ(gc.out, "removed deploy/killed\n");
  EXPECT_EQ(state_files(backend_dir_), (std::vector<std::string>{"n.deploy%2Fheld.s"}));
  // The holder still holds: a second run is busy.
  EXPECT_EQ(run(lock_sh("deploy/held", "true", {"--timeout", "0"})).status, 75);
  write_file(path("held.release"), "");
  EXPECT_EQ(wait_exit(holder), 0);
  EXPECT_TRUE(state_files(backend_dir_).empty());

  // -q prints nothing; an unknown option is a usage error. The killed run's watcher (a process
  // of its own, which the test cannot wait for) keeps the name in use until it has killed the
  // command: gc removes the file once it is gone, not necessarily at the first look.
  auto again = hold_until("deploy/again", path("again.ready"), path("never"));
  kill(again.pid, SIGKILL);
  wait_exit(again);
  ASSERT_TRUE(wait_until([&] { return state_files(backend_dir_).size() == 1; }));
  EXPECT_TRUE(wait_until([&] {
    const auto quiet = run({"gc", "-q", "--backend", backend_});
    EXPECT_EQ(quiet.status, 0) << quiet.err;
    EXPECT_EQ(quiet.out, "");
    return state_files(backend_dir_).empty();
  }));
  EXPECT_EQ(run({"gc", "--frobnicate"}).status, 64);
  const auto help = run({"gc", "--help"});
  EXPECT_NE(help.out.find("PREFIX"), std::string::npos) << help.out;
}

}  // namespace
