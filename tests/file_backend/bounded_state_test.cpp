// SPDX-License-Identifier: Apache-2.0
// Issue 24 item 1: what the file:// directory keeps is bounded by the names in use, not by the
// names ever used. A name's state file is removed by the last process using it as it closes the
// name; a process opening it meanwhile finds it gone and uses a fresh one (never two holders
// through two files); Client::collect_unused (turnstile gc) removes what crashed processes left.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <turnstile/turnstile.hpp>

#include "../../src/backends/file/state.hpp"
#include "file_backend/scratch_root.hpp"

namespace {

namespace fs = std::filesystem;
namespace layout = turnstile::detail::file_state;
using namespace std::chrono_literals;
using turnstile::Client;
using Clock = std::chrono::steady_clock;

// The state files (and anything else) in a directory.
std::vector<std::string> entries_of(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// Each test's own scratch directory, removed with everything in it even when the test fails.
class FileBoundedState : public file_backend_test::ScratchRoot {};
class FileCollectUnused : public file_backend_test::ScratchRoot {};

// A tmpfs of `size` mounted on a fresh directory for the test (root only), unmounted after.
class SmallTmpfs {
 public:
  explicit SmallTmpfs(const char* size) {
    if (geteuid() != 0) return;
    if (!mkdtemp(dir_)) return;
    const std::string options = std::string("size=") + size + ",mode=0700";
    mounted_ = mount("tmpfs", dir_, "tmpfs", 0, options.c_str()) == 0;
  }
  ~SmallTmpfs() {
    if (mounted_) umount2(dir_, MNT_DETACH);
    rmdir(dir_);
  }
  bool mounted() const { return mounted_; }
  std::string root() const { return std::string(dir_) + "/locks"; }

 private:
  char dir_[40] = "/tmp/turnstile-bounded-XXXXXX";
  bool mounted_ = false;
};

// How many distinct names the run uses: TURNSTILE_BOUNDED_NAMES, else `default_count` (the
// CTest label state_100k runs 100,000; make test's run is shorter).
int names_to_use(int default_count) {
  const char* given = std::getenv("TURNSTILE_BOUNDED_NAMES");
  return given && *given ? std::atoi(given) : default_count;
}

// Before: the 257th name failed with "no room for the state of 'deploy/build-256'" on a 1 MiB
// tmpfs, every name's state file kept until reboot. Now one client uses name after name, each
// acquired and released, and the directory holds only the few names it keeps open.
TEST_F(FileBoundedState, ManyNamesOneAfterAnotherFitInASmallTmpfs) {
  SmallTmpfs tmpfs("1m");
  if (!tmpfs.mounted()) GTEST_SKIP() << "needs root to mount a small tmpfs";
  const int count = names_to_use(10'000);
  const auto started = Clock::now();
  {
    auto client = Client::connect("file://" + tmpfs.root());
    for (int i = 0; i < count; ++i) {
      auto mutex = client.mutex("deploy/build-" + std::to_string(i));
      ASSERT_NO_THROW(mutex.lock()) << "name " << i;
      mutex.unlock();
    }
    EXPECT_LE(entries_of(tmpfs.root()).size(), 20u) << "the names a client keeps open, and no more";
  }
  const auto took = std::chrono::duration<double>(Clock::now() - started).count();
  std::printf("%d names in %.2f s (%.1f us each)\n", count, took, took * 1e6 / count);
  EXPECT_TRUE(entries_of(tmpfs.root()).empty()) << "a closed client leaves nothing behind";
}

// The same with one process per name, as `turnstile run --lock deploy/build-$ID` does.
TEST_F(FileBoundedState, AClientPerNameLeavesNothingBehind) {
  SmallTmpfs tmpfs("1m");
  if (!tmpfs.mounted()) GTEST_SKIP() << "needs root to mount a small tmpfs";
  for (int i = 0; i < 400; ++i) {
    auto client = Client::connect("file://" + tmpfs.root());
    auto mutex = client.mutex("deploy/build-" + std::to_string(i));
    ASSERT_NO_THROW(mutex.lock()) << "name " << i;
    mutex.unlock();
  }
  EXPECT_TRUE(entries_of(tmpfs.root()).empty());
}

// What the racers share (an anonymous shared mapping made before fork).
struct RaceBoard {
  static constexpr int kNames = 3;
  std::atomic<int> inside[kNames];  // holders of each name right now: never above 1
  std::atomic<std::uint64_t> last_token[kNames];
  std::atomic<int> overlaps;           // a second holder found the name held
  std::atomic<int> token_regressions;  // a token not above the one before it
  std::atomic<int> errors;             // any exception
  std::atomic<int> holds;
  std::atomic<std::uint64_t> inodes[kNames][64];  // state files seen by holders (distinct ones)
  std::atomic<int> inode_count[kNames];
};

void note_inode(RaceBoard& board, int which, std::uint64_t inode) {
  const int seen = std::min(board.inode_count[which].load(), 64);
  for (int i = 0; i < seen; ++i) {
    if (board.inodes[which][i].load() == inode) return;
  }
  const int slot = board.inode_count[which].fetch_add(1);
  if (slot < 64) board.inodes[which][slot].store(inode);
}

// One racer: a fresh client per round (closing it removes the name's file when nobody else uses
// it), a random one of the few names, held briefly while the board checks exclusion.
void race(RaceBoard& board, const std::string& root, unsigned seed, int rounds) {
  for (int round = 0; round < rounds; ++round) {
    const int which = static_cast<int>((seed + static_cast<unsigned>(round) * 7u) % RaceBoard::kNames);
    const std::string name = "race/" + std::to_string(which);
    try {
      auto client = Client::connect("file://" + root);
      auto mutex = client.mutex(name);
      mutex.lock();
      if (board.inside[which].fetch_add(1) != 0) board.overlaps.fetch_add(1);
      const auto token = mutex.fencing_token();
      if (token <= board.last_token[which].load()) board.token_regressions.fetch_add(1);
      board.last_token[which].store(token);
      struct stat st {};
      if (stat((root + "/n.race%2F" + std::to_string(which) + ".s").c_str(), &st) == 0) {
        note_inode(board, which, st.st_ino);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50 + (seed + round) % 100));
      board.inside[which].fetch_sub(1);
      board.holds.fetch_add(1);
      mutex.unlock();
    } catch (const std::exception& error) {
      std::fprintf(stderr, "racer %u: %s\n", seed, error.what());
      board.errors.fetch_add(1);
    }
  }
}

// Processes and threads take and release the same few names, each closing its client after
// every hold, so state files are removed and made afresh under the others' feet. Never two
// holders at once, tokens keep growing, no error; and the files really were removed meanwhile.
TEST_F(FileBoundedState, RemovalRacingOpenersKeepsMutualExclusion) {
  const std::string root = scratch_ + "/locks";
  void* shared = mmap(nullptr, sizeof(RaceBoard), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(shared, MAP_FAILED);
  auto& board = *new (shared) RaceBoard{};
  constexpr int kProcesses = 4, kThreads = 3, kRounds = 150;
  std::vector<pid_t> children;
  for (int p = 0; p < kProcesses; ++p) {
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid == 0) {
      std::vector<std::thread> threads;
      for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back(race, std::ref(board), root, static_cast<unsigned>(p * kThreads + t), kRounds);
      }
      for (auto& thread : threads) thread.join();
      std::fflush(nullptr);
      _exit(0);
    }
    ASSERT_GT(pid, 0);
    children.push_back(pid);
  }
  for (const pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  }
  EXPECT_EQ(board.holds.load(), kProcesses * kThreads * kRounds);
  EXPECT_EQ(board.errors.load(), 0);
  EXPECT_EQ(board.overlaps.load(), 0) << "two holders of one name at once";
  EXPECT_EQ(board.token_regressions.load(), 0);
  for (int which = 0; which < RaceBoard::kNames; ++which) {
    EXPECT_GT(board.inode_count[which].load(), 1) << "the state file of race/" << which << " was never removed";
  }
  EXPECT_TRUE(entries_of(root).empty());
  munmap(shared, sizeof(RaceBoard));
}

// A PermitCounter's count lives in its state file: a change made in a file another client just
// removed as unused would be lost. Threads open a fresh name, close it (removing its file when
// nobody else uses it) and add a permit, all at once: every permit counts.
TEST_F(FileBoundedState, ACounterChangeIsNeverLostToARemovedFile) {
  const std::string url = "file://" + scratch_ + "/locks";
  constexpr int kThreads = 4, kRounds = 500;
  std::atomic<int> errors{0};
  std::atomic<int> lost{0};
  for (int round = 0; round < kRounds; ++round) {
    const std::string name = "count/" + std::to_string(round);
    std::atomic<int> ready{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        try {
          auto adder = Client::connect(url);
          auto counter = adder.permit_counter(name);
          ++ready;
          while (ready.load() < kThreads) std::this_thread::yield();
          if (t % 2 == 0) {
            auto opener = Client::connect(url);
            auto mutex = opener.mutex(name);
            if (mutex.try_lock()) mutex.unlock();
          }
          counter.add_permits(1);
        } catch (const std::exception& error) {
          std::fprintf(stderr, "%s\n", error.what());
          ++errors;
        }
      });
    }
    for (auto& thread : threads) thread.join();
    if (Client::connect(url).permit_counter(name).available_permits() != kThreads) ++lost;
  }
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(lost.load(), 0) << "rounds that lost a permit";
}

// A remover killed between unlinking a file and marking it removed (kill -9 at the worst
// moment) leaves an unmarked file no longer at its path: the next to take its mutex (robust:
// EOWNERDEAD) marks it, so a counter change made through a client that kept the file open lands
// in the file at the path, not in the orphan. (Red team of issue 24: the change was lost.)
TEST_F(FileBoundedState, ARemoverKilledMidRemovalLosesNoCounterChange) {
  const std::string root = scratch_ + "/locks";
  auto client = Client::connect("file://" + root);
  auto counter = client.permit_counter("c");
  EXPECT_EQ(counter.available_permits(), 0);  // the file is open in this client, never set
  const std::string state = root + "/n.c.s";
  std::fflush(nullptr);
  const pid_t remover = fork();
  if (remover == 0) {
    // What remove_if_unused does, dying after the unlink: mutex taken, file unlinked, no mark.
    // A second link keeps the file's link count up, as a creator's temporary name can for a
    // moment: the client's cached file then looks in place until it takes the mutex.
    const int fd = open(state.c_str(), O_RDWR);
    void* map = fd < 0 ? MAP_FAILED : mmap(nullptr, sizeof(layout::Header), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED || link(state.c_str(), (state + ".tmp.keep").c_str()) != 0) _exit(2);
    if (pthread_mutex_lock(&static_cast<layout::Header*>(map)->mutex) != 0) _exit(3);
    _exit(unlink(state.c_str()) == 0 ? 0 : 4);
  }
  int status = 0;
  ASSERT_EQ(waitpid(remover, &status, 0), remover);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  ASSERT_FALSE(fs::exists(state));
  counter.add_permits(1);
  EXPECT_EQ(Client::connect("file://" + root).permit_counter("c").available_permits(), 1)
      << "the permit went into the removed file";
}

// Closing an idle name tries its removal without waiting: a process paused inside the name's
// mutex (a debugger, SIGSTOP at the worst moment) must not stall the client's other names.
TEST_F(FileBoundedState, ClosingANameNeverWaitsOnAProcessInsideItsMutex) {
  const std::string root = scratch_ + "/locks";
  auto client = Client::connect("file://" + root);
  {
    auto stuck = client.mutex("stuck");
    stuck.lock();
    stuck.unlock();
  }
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    // Holds the name's mutex and stays inside.
    const int fd = open((root + "/n.stuck.s").c_str(), O_RDWR);
    void* map = mmap(nullptr, sizeof(layout::Header), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (fd < 0 || map == MAP_FAILED) _exit(1);
    pthread_mutex_lock(&static_cast<layout::Header*>(map)->mutex);
    char byte = '!';
    if (write(ready[1], &byte, 1) != 1) _exit(1);
    pause();
    _exit(0);
  }
  ASSERT_GT(pid, 0);
  char byte = 0;
  ASSERT_EQ(read(ready[0], &byte, 1), 1);
  // More names than a client keeps open: "stuck" is closed, and its removal tried.
  auto others = std::async(std::launch::async, [&] {
    for (int i = 0; i < 20; ++i) {
      auto mutex = client.mutex("other-" + std::to_string(i));
      mutex.lock();
      mutex.unlock();
    }
  });
  const bool finished = others.wait_for(10s) == std::future_status::ready;
  kill(pid, SIGKILL);  // frees a stalled client (the mutex is robust), so the test ends
  waitpid(pid, nullptr, 0);
  others.get();
  close(ready[0]);
  close(ready[1]);
  EXPECT_TRUE(finished) << "closing a name waited on the process inside its mutex";
  EXPECT_TRUE(fs::exists(root + "/n.stuck.s")) << "removed while a process was inside it";
}

// A child that takes `name` and then is killed with SIGKILL: its state file stays behind (only
// the last user's clean close removes one), holding a dead entry.
void crash_while_holding(const std::string& root, const std::string& name) {
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    auto client = Client::connect("file://" + root);
    auto mutex = client.mutex(name);
    mutex.lock();
    char byte = '!';
    if (write(ready[1], &byte, 1) != 1) _exit(1);
    pause();
    _exit(0);
  }
  ASSERT_GT(pid, 0);
  close(ready[1]);
  char byte = 0;
  EXPECT_EQ(read(ready[0], &byte, 1), 1);
  close(ready[0]);
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

// Client::collect_unused (turnstile gc) removes the state crashed processes left, and never a
// name held, waited for or keeping a PermitCounter value; a prefix limits it.
TEST_F(FileCollectUnused, RemovesWhatCrashedProcessesLeftAndNothingInUse) {
  const std::string root = scratch_ + "/locks";
  crash_while_holding(root, "deploy/crashed");
  crash_while_holding(root, "other/crashed");
  auto client = Client::connect("file://" + root);
  auto held = client.mutex("deploy/held");
  held.lock();
  auto counter = client.permit_counter("deploy/counter");
  ASSERT_TRUE(counter.try_set_permits(3));
  // A waiter behind a holder in another client: its name is in use too.
  std::optional<Client> other = Client::connect("file://" + root);
  std::optional<turnstile::Mutex> blocker = other->mutex("deploy/waited");
  blocker->lock();
  std::atomic<bool> admitted{false};
  std::thread waiter([&] {
    auto mutex = client.mutex("deploy/waited");
    mutex.lock();
    admitted = true;
    mutex.unlock();
  });
  ASSERT_TRUE([&] {
    for (auto until = Clock::now() + 10s; Clock::now() < until; std::this_thread::sleep_for(5ms)) {
      if (client.inspect("deploy/waited").waiters.size() == 1) return true;
    }
    return false;
  }()) << "the waiter never queued";
  // A file a process killed while creating a state file left, an hour old.
  const std::string temp = root + "/n.deploy%2Fx.tmp.1.2";
  std::ofstream(temp) << "";
  const timespec an_hour_ago[2] = {{time(nullptr) - 3600, 0}, {time(nullptr) - 3600, 0}};
  ASSERT_EQ(utimensat(AT_FDCWD, temp.c_str(), an_hour_ago, 0), 0);
  const auto before = entries_of(root);
  ASSERT_NE(std::find(before.begin(), before.end(), "n.deploy%2Fcrashed.s"), before.end());

  const auto removed = client.collect_unused("deploy/");
  EXPECT_EQ(removed, (std::vector<std::string>{"(unfinished state file n.deploy%2Fx.tmp.1.2)", "deploy/crashed"}));
  const auto after = entries_of(root);
  EXPECT_EQ(after, (std::vector<std::string>{"n.deploy%2Fcounter.s", "n.deploy%2Fheld.s", "n.deploy%2Fwaited.s",
                                             "n.other%2Fcrashed.s"}));
  EXPECT_FALSE(admitted.load());
  EXPECT_EQ(counter.available_permits(), 3);
  EXPECT_TRUE(held.owns_lock());
  blocker->unlock();
  waiter.join();
  EXPECT_TRUE(admitted.load());
  // A client that held a name keeps its pin while it keeps the name open (kept pins,
  // docs/architecture.md): in use until it closes it, and then removed by it, the last user.
  EXPECT_EQ(client.collect_unused(""), (std::vector<std::string>{"other/crashed"}));
  blocker.reset();
  other.reset();
  EXPECT_EQ(entries_of(root), (std::vector<std::string>{"n.deploy%2Fcounter.s", "n.deploy%2Fheld.s"}));
  held.unlock();
  EXPECT_EQ(client.collect_unused(""), (std::vector<std::string>{"deploy/held"}));
}

}  // namespace
