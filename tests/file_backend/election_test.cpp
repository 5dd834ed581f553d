// SPDX-License-Identifier: Apache-2.0
// file:// elections (issue 27): each candidate's value is a file beside the state file
// (<base>.v.<seq>, src/backends/file/values.hpp), ended with its entry, whoever ends it (the
// candidate, or whoever finds it dead), and taken by `turnstile gc` when a crash left one no
// entry refers to; and the LeaderObserver's wait is woken by events (a proclaim's rename, the
// leader's death), never by a timer.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include <turnstile/turnstile.hpp>

#include "core/backend.hpp"
#include "core/backend_loader.hpp"
#include "core/telemetry.hpp"
#include "core/url.hpp"
#include "file_backend/scratch_root.hpp"

namespace file_backend_test {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

class FileElection : public ScratchRoot {
 protected:
  std::string root() const { return scratch_ + "/root"; }
  // The value files of `name` (a name kept as is in file names), sorted.
  std::vector<std::string> value_files(const std::string& name) const {
    std::vector<std::string> found;
    for (const auto& entry : fs::directory_iterator(root())) {
      const auto file_name = entry.path().filename().string();
      if (file_name.starts_with("n." + name + ".v.")) found.push_back(file_name);
    }
    std::sort(found.begin(), found.end());
    return found;
  }
  std::string contents(const std::string& file_name) const {
    std::ifstream in(root() + "/" + file_name, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  // A child process that leads `name` with `value` and then waits to be killed; nullopt-like
  // pid 0 when it never led.
  pid_t child_leading(const std::string& name, const std::string& value) {
    int ready[2];
    if (pipe2(ready, O_CLOEXEC) != 0) return 0;
    std::fflush(nullptr);
    const pid_t child = fork();
    if (child == 0) {
      try {
        auto client = turnstile::Client::connect(url_);
        auto election = client.election(name);
        election.campaign(value);
        if (write(ready[1], "!", 1) != 1) _exit(98);
        for (;;) pause();
      } catch (...) {
      }
      _exit(99);
    }
    close(ready[1]);
    pollfd pfd{ready[0], POLLIN, 0};
    const bool leads = poll(&pfd, 1, 10000) == 1;
    close(ready[0]);
    if (!leads) kill_child(child);
    return leads ? child : 0;
  }
  static void kill_child(pid_t child) {
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
  }
};

// A value file lives exactly as long as its entry: resigned, or found dead by the next
// candidate, it is gone; the name's last candidate leaves nothing behind.
TEST_F(FileElection, ValuesEndWithTheirEntries) {
  auto client = turnstile::Client::connect(url_);
  auto first = client.election("e");
  first.campaign("one");
  ASSERT_EQ(value_files("e").size(), 1u);
  EXPECT_EQ(contents(value_files("e").front()), "one");
  first.proclaim("two");
  ASSERT_EQ(value_files("e").size(), 1u);  // replaced in place, no second file
  EXPECT_EQ(contents(value_files("e").front()), "two");
  first.resign();
  EXPECT_TRUE(value_files("e").empty());

  const pid_t child = child_leading("k", "doomed");
  ASSERT_NE(child, 0) << "the child never led";
  ASSERT_EQ(value_files("k").size(), 1u);
  kill_child(child);  // its entry and value stay until someone finds it dead
  ASSERT_EQ(value_files("k").size(), 1u);
  auto next = client.election("k");
  ASSERT_TRUE(next.campaign_for("next", 10s));
  const auto left = value_files("k");
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(contents(left.front()), "next");
  next.resign();
  EXPECT_TRUE(value_files("k").empty());
}

// What a crash between placing a value and appending its slot (or between removing the two)
// leaves, gc removes; a value in use, or one too young to be a crash's, it keeps.
TEST_F(FileElection, GcRemovesValuesNoEntryRefersTo) {
  auto client = turnstile::Client::connect(url_);
  auto leader = client.election("e");
  leader.campaign("kept");
  std::ofstream(root() + "/n.e.v.1") << "orphan";    // a seq no slot has, beside a live state file
  std::ofstream(root() + "/n.gone.v.5") << "old";    // no state file, an hour old
  std::ofstream(root() + "/n.gone.v.6") << "young";  // no state file, just made: maybe a creator's
  const timespec an_hour_ago[2] = {{time(nullptr) - 3600, 0}, {time(nullptr) - 3600, 0}};
  ASSERT_EQ(utimensat(AT_FDCWD, (root() + "/n.gone.v.5").c_str(), an_hour_ago, 0), 0);
  EXPECT_TRUE(client.collect_unused("other/").empty());  // not under the prefix: kept
  const auto removed = client.collect_unused("");
  EXPECT_EQ(removed, (std::vector<std::string>{"(leader value of a gone entry n.e.v.1)",
                                               "(leader value of a gone entry n.gone.v.5)"}));
  const auto left = value_files("e");
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(contents(left.front()), "kept");
  EXPECT_TRUE(fs::exists(root() + "/n.gone.v.6"));
  EXPECT_EQ(leader.leader()->value, "kept");
}

// A proclaim writes only while the leader's entry is in the file at the name's path: with the
// state file removed by hand (rm, a tmp cleaner) before the watcher noticed, it is refused
// with HoldLost, the leadership is lost, and the old value stays as it was.
TEST_F(FileElection, ProclaimInARemovedStateFileIsHoldLost) {
  auto client = turnstile::Client::connect(url_);
  auto leader = client.election("e");
  leader.campaign("one");
  ASSERT_EQ(unlink(state_of("e").c_str()), 0);
  EXPECT_THROW(leader.proclaim("two"), turnstile::HoldLost);
  EXPECT_EQ(leader.hold_state(), turnstile::HoldState::lost);
  const auto left = value_files("e");
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(contents(left.front()), "one");
}

// The observer's wait sleeps until the leader may have changed: through a whole second with no
// change (a polling wait returns every Backend::kLeaderPoll, 500 ms), then woken by a proclaim
// of another client and by the death of a leader in another process.
TEST_F(FileElection, ObserverWaitIsWokenByEventsOnly) {
  auto client = turnstile::Client::connect(url_);
  auto leader = client.election("e");
  leader.campaign("a");
  turnstile::detail::Telemetry telemetry("file", false, {});  // file:// reports nothing
  auto backend =
      turnstile::detail::make_file_backend(turnstile::detail::parse_url(url_), {}, telemetry.backend_reports());
  auto watch = backend->watch_leader("e");
  auto start = Clock::now();
  watch->wait(start + 1200ms, {});
  EXPECT_GE(Clock::now() - start, 1100ms) << "woken with no change: a poll, not an event";

  std::thread proclaimer([&] {
    std::this_thread::sleep_for(100ms);
    leader.proclaim("b");
  });
  start = Clock::now();
  watch->wait(start + 20s, {});
  const auto proclaim_wake = Clock::now() - start;
  proclaimer.join();
  EXPECT_LT(proclaim_wake, 10s) << "the proclaim did not wake the observer";

  const pid_t child = child_leading("k", "doomed");
  ASSERT_NE(child, 0) << "the child never led";
  auto killed_watch = backend->watch_leader("k");
  std::thread killer([&] {
    std::this_thread::sleep_for(100ms);
    kill_child(child);
  });
  start = Clock::now();
  killed_watch->wait(start + 20s, {});
  const auto death_wake = Clock::now() - start;
  killer.join();
  EXPECT_LT(death_wake, 10s) << "the leader's death did not wake the observer";
  EXPECT_FALSE(client.election("k").leader());
}

}  // namespace
}  // namespace file_backend_test
