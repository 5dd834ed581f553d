// SPDX-License-Identifier: Apache-2.0
// Issue 26 round 3: a name's queue on file:// grows beyond the 1024 entries a state file first
// has room for (state file version 6): blocking waiters of several processes queue beyond it, a
// process killed while growing the file leaves one the next user repairs, the storage of a long
// queue goes back to the file system once it drains, and files of earlier versions are never
// misread (by either side).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <turnstile/turnstile.hpp>

#include "../../src/backends/file/state.hpp"
#include "file_backend/scratch_root.hpp"
#include "wakeups/async_crowd.hpp"

namespace {

namespace fs = std::filesystem;
namespace layout = turnstile::detail::file_state;
using namespace std::chrono_literals;
using turnstile::Client;
using Clock = std::chrono::steady_clock;

// The exit status of `pid` (128 + signal when killed), or -1 when it did not end in time (it is
// killed then).
int wait_for_exit(pid_t pid, std::chrono::seconds timeout) {
  const auto end = Clock::now() + timeout;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (Clock::now() > end) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(20ms);
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::uintmax_t stored_bytes(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 ? static_cast<std::uintmax_t>(st.st_blocks) * 512 : 0;
}

class FileGrowth : public file_backend_test::ScratchRoot {};

// What the admitted threads of every process record, in memory the processes share.
struct Admissions {
  std::atomic<int> admitted{0};
  std::atomic<int> holding{0};
  std::atomic<int> overlaps{0};
  std::atomic<int> out_of_order{0};
  std::atomic<int> failures{0};
  std::atomic<std::uint64_t> last_token{0};
};

// In a child: `waiters` threads each lock `name` (blocking), record the admission, unlock.
int lock_on_threads(const std::string& url, const std::string& name, int waiters, Admissions& shared) {
  wakeups::raise_descriptor_limit();
  auto client = Client::connect(url);
  std::vector<std::thread> threads;
  for (int i = 0; i < waiters; ++i) {
    threads.emplace_back([&] {
      try {
        auto mutex = client.mutex(name);
        mutex.lock();
        if (shared.holding.fetch_add(1) != 0) shared.overlaps.fetch_add(1);
        const auto token = mutex.fencing_token();
        if (token <= shared.last_token.exchange(token)) shared.out_of_order.fetch_add(1);
        shared.admitted.fetch_add(1);
        shared.holding.fetch_sub(1);
        mutex.unlock();
      } catch (const std::exception& error) {
        std::fprintf(stderr, "waiter in %d: %s\n", getpid(), error.what());
        shared.failures.fetch_add(1);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  return 0;
}

// Two processes' blocking waiters, 1,200 of them, queue behind a holder: beyond the 1024 entries
// the state file first has room for (QueueFull before version 6). Each is admitted once, alone,
// in token order.
TEST_F(FileGrowth, BlockingWaitersOfTwoProcessesQueueBeyondTheFirstCapacity) {
  constexpr int kPerProcess = 600;
  void* memory = mmap(nullptr, sizeof(Admissions), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(memory, MAP_FAILED);
  auto* shared = new (memory) Admissions;
  int go[2];
  ASSERT_EQ(pipe(go), 0);
  // Forked while this process has no threads; each child starts once the name is held.
  std::vector<pid_t> children;
  for (int c = 0; c < 2; ++c) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      close(go[1]);
      char byte;
      if (read(go[0], &byte, 1) != 1) _exit(96);
      _exit(lock_on_threads(url_, "crowd", kPerProcess, *shared));
    }
    children.push_back(pid);
  }
  close(go[0]);
  auto client = Client::connect(url_);
  auto holder = client.mutex("crowd");
  holder.lock();
  ASSERT_EQ(write(go[1], "!!", 2), 2);
  close(go[1]);
  const bool queued = eventually(
      [&] { return client.inspect("crowd").waiters.size() == 2 * kPerProcess || shared->failures > 0; }, 120s);
  EXPECT_TRUE(queued && shared->failures == 0)
      << client.inspect("crowd").waiters.size() << " waiting, " << shared->failures << " failed to queue";
  EXPECT_EQ(shared->admitted, 0) << "admitted while the name was held";
  EXPECT_GE(fs::file_size(state_of("crowd")), layout::file_size(2 * layout::kFirstCapacity)) << "the file never grew";
  holder.unlock();
  for (const pid_t pid : children) EXPECT_EQ(wait_for_exit(pid, 180s), 0);
  EXPECT_EQ(shared->admitted, 2 * kPerProcess);
  EXPECT_EQ(shared->overlaps, 0) << "two holders at once";
  EXPECT_EQ(shared->out_of_order, 0) << "tokens not increasing in admission order";
  EXPECT_EQ(shared->failures, 0);
  munmap(memory, sizeof(Admissions));
}

// A name held, with `count` async acquires queued behind the holder (entries: 1 + count).
struct Crowd {
  Client client;
  turnstile::Mutex holder;
  wakeups::AsyncCrowd waiting;
  Crowd(const std::string& url, const std::string& name, std::size_t count, turnstile::ClientOptions options = {})
      : client(Client::connect(url, std::move(options))), holder(client.mutex(name)), waiting(count + 1) {
    holder.lock();
    for (std::size_t i = 0; i < count; ++i) waiting.add(client.mutex(name));
  }
  // Releases the holder, then each admitted acquire in turn: true when all `count` were admitted
  // one at a time, in queue order (tokens increasing). (The pool's threads may take the joins of
  // acquires started one after another in either order: the queue's order is the tokens'.)
  bool drain(std::size_t count) {
    holder.unlock();
    std::uint64_t last = 0;
    for (std::size_t k = 0; k < count; ++k) {
      const auto index = waiting.wait_for_admission(k, 30s);
      auto lease = index ? waiting.take(*index) : std::nullopt;
      if (!lease || lease->fencing_token() <= last || waiting.admitted() != k + 1) {
        ADD_FAILURE() << "admission " << k << ": acquire " << (index ? std::to_string(*index) : "none")
                      << ", errors: " << waiting.errors().size();
        return false;
      }
      last = lease->fencing_token();
    }
    return true;
  }
};

// A process killed while growing the file, with the state mutex held (the next locker gets
// EOWNERDEAD and repairs): between the file's extension and the header's new capacity, or just
// after the capacity was written. Either way nothing is lost and the queue goes on growing.
class FileGrowthCrash : public FileGrowth, public ::testing::WithParamInterface<bool> {};

TEST_P(FileGrowthCrash, AProcessKilledWhileGrowingTheFileLeavesItWhole) {
  const bool capacity_written = GetParam();
  Crowd crowd(url_, "m", layout::kFirstCapacity - 1);
  auto observer = Client::connect(url_);
  ASSERT_TRUE(eventually([&] { return observer.inspect("m").waiters.size() == layout::kFirstCapacity - 1; }, 60s));
  ASSERT_EQ(fs::file_size(state_of("m")), layout::file_size(layout::kFirstCapacity)) << "full, not grown yet";
  // The crash: only system calls and the shared mutex in the child (this process has threads).
  const std::string path = state_of("m");
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const int fd = open(path.c_str(), O_RDWR);
    void* map = mmap(nullptr, layout::kSlotsOffset, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (fd < 0 || map == MAP_FAILED) _exit(3);
    auto* header = static_cast<layout::Header*>(map);
    pthread_mutex_lock(&header->mutex);
    if (ftruncate(fd, static_cast<off_t>(layout::file_size(2 * layout::kFirstCapacity))) != 0) _exit(4);
    if (capacity_written) header->capacity = 2 * layout::kFirstCapacity;
    _exit(0);  // the mutex dies with us
  }
  ASSERT_EQ(wait_for_exit(pid, 10s), 0);
  // The next entry needs room beyond the first capacity.
  crowd.waiting.add(crowd.client.mutex("m"));
  ASSERT_TRUE(eventually([&] { return observer.inspect("m").waiters.size() == layout::kFirstCapacity; }, 30s))
      << "the entry beyond the first capacity never queued";
  const auto queued = observer.inspect("m");
  EXPECT_EQ(queued.holders.size(), 1u);
  EXPECT_EQ(fs::file_size(state_of("m")), layout::file_size(2 * layout::kFirstCapacity));
  EXPECT_TRUE(crowd.drain(layout::kFirstCapacity)) << "an entry was lost, or admitted out of order";
}

INSTANTIATE_TEST_SUITE_P(File, FileGrowthCrash, ::testing::Bool(), [](const auto& param_info) {
  return std::string(param_info.param ? "AfterTheCapacityWasWritten" : "BeforeTheCapacityWasWritten");
});

// A queue that grew to 3,000 entries gives its slots' storage back once it drains (the file keeps
// its size, sparse): the disk a name uses is bounded by the entries it has, not by the most it
// ever had.
TEST_F(FileGrowth, ADrainedQueueGivesItsStorageBack) {
  wakeups::raise_descriptor_limit();
  constexpr std::size_t kWaiters = 3000;
  Crowd crowd(url_, "long", kWaiters);
  auto observer = Client::connect(url_);
  ASSERT_TRUE(eventually([&] { return observer.inspect("long").waiters.size() == kWaiters; }, 60s));
  const auto full = stored_bytes(state_of("long"));
  EXPECT_GE(full, kWaiters * sizeof(layout::Slot)) << "the slots in use have storage";
  ASSERT_TRUE(crowd.drain(kWaiters));
  const auto drained = stored_bytes(state_of("long"));
  std::printf("state file: %ju bytes, %ju stored with 3,001 entries, %ju once drained\n",
              static_cast<std::uintmax_t>(fs::file_size(state_of("long"))), full, drained);
  EXPECT_LT(drained, full / 3) << "the drained queue's storage was kept";
  // And the name works as before.
  auto mutex = observer.mutex("long");
  EXPECT_TRUE(mutex.try_lock());
  mutex.unlock();
}

// Labels have a table of 1,024 places, whatever the queue's length: the entries of one client
// share their label's place, so 1,101 entries with two labels all keep theirs.
TEST_F(FileGrowth, EntriesWithOneLabelShareItsPlace) {
  turnstile::ClientOptions crowd_options;
  crowd_options.holder_label = "crowd of " + std::to_string(getpid());
  Crowd crowd(url_, "labelled", 1100, crowd_options);
  turnstile::ClientOptions other_options;
  other_options.holder_label = "the other one";
  auto other = Client::connect(url_, other_options);
  ASSERT_TRUE(eventually([&] { return other.inspect("labelled").waiters.size() == 1100; }, 60s));
  auto last = other.mutex("labelled").lock_async();
  ASSERT_TRUE(eventually([&] { return other.inspect("labelled").waiters.size() == 1101; }, 60s));
  const auto queued = other.inspect("labelled");
  ASSERT_EQ(queued.holders.size(), 1u);
  EXPECT_EQ(queued.holders.front().label, crowd_options.holder_label);
  for (std::size_t i = 0; i + 1 < queued.waiters.size(); ++i) {
    ASSERT_EQ(queued.waiters[i].label, crowd_options.holder_label) << "waiter " << i;
  }
  EXPECT_EQ(queued.waiters.back().label, other_options.holder_label);
  last.cancel();
  ASSERT_TRUE(crowd.drain(1100));
}

// A file of version 5 (or earlier: they all began with the magic "TSL1") written in this boot
// may be in use by a process of that version: refused with a clear error and left as it is, by
// clients and by gc. One from an earlier boot is replaced, keeping its fencing counter. And a
// version-6 file never begins as theirs do: those versions refuse any file without their magic.
TEST_F(FileGrowth, AVersion5FileIsRefusedAndAVersion6FileIsNotOneOfTheirs) {
  constexpr off_t kVersion5Size = 304'528;  // its header: 1024 slots and 1024 labels
  auto client = Client::connect(url_);
  auto current = client.mutex("v6");
  current.lock();  // makes the directory and a file of this version
  std::uint32_t magic = 0;
  {
    const int fd = open(state_of("v6").c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(pread(fd, &magic, sizeof magic, 0), 4);
    close(fd);
  }
  EXPECT_NE(magic, layout::kOldMagic) << "a version-5 binary would take a version-6 file for its own";
  current.unlock();
  // An older version's file in place of it (as written in this boot).
  const auto old_path = state_of("old");
  {
    const int fd = open(old_path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, kVersion5Size), 0);
    std::uint32_t start[2] = {layout::kOldMagic, 5};
    char boot[40] = {};
    std::ifstream("/proc/sys/kernel/random/boot_id").getline(boot, sizeof boot);
    const std::uint64_t next_seq = 1'000'000'000'000'000;
    ASSERT_EQ(pwrite(fd, start, sizeof start, 0), 8);
    ASSERT_EQ(pwrite(fd, boot, sizeof boot, offsetof(layout::Header, boot_id)), 40);
    ASSERT_EQ(pwrite(fd, &next_seq, sizeof next_seq, offsetof(layout::Header, next_seq)), 8);
    close(fd);
  }
  try {
    Client::connect(url_).mutex("old").try_lock();
    ADD_FAILURE() << "used a version-5 state file";
  } catch (const turnstile::BackendUnavailable& error) {
    EXPECT_NE(std::string(error.what()).find("older turnstile version"), std::string::npos) << error.what();
  }
  EXPECT_TRUE(Client::connect(url_).collect_unused("old").empty()) << "gc removed a file its version may use";
  EXPECT_EQ(fs::file_size(old_path), static_cast<std::uintmax_t>(kVersion5Size)) << "changed";
  // From an earlier boot: replaced by a file of this version, the fencing counter kept.
  {
    const int fd = open(old_path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    const char other_boot[40] = "00000000-0000-0000-0000-000000000000";
    ASSERT_EQ(pwrite(fd, other_boot, sizeof other_boot, offsetof(layout::Header, boot_id)), 40);
    close(fd);
  }
  auto mutex = Client::connect(url_).mutex("old");
  ASSERT_TRUE(mutex.try_lock());
  EXPECT_GT(mutex.fencing_token(), 1'000'000'000'000'000u);
  mutex.unlock();
}

}  // namespace
