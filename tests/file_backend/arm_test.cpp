// SPDX-License-Identifier: Apache-2.0
// Issue 26: file:// waits without a thread per waiter. The core's async driver arms a wake-up
// (QueuePlace::arm, CounterLine::arm) where the blocking loop sleeps; these tests drive the
// storage as that driver does (join, look, next_queue_step, arm, wait for the wake, look again)
// and count the process's threads: 1,000 waiters on one name armed at once add at most a few
// (before, one thread each), releases admit them one by one in queue order and each wakes only
// the next, and a holder in another process killed with kill -9 still wakes the waiter behind it.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include <turnstile/turnstile.hpp>

#include "backends/file/os.hpp"
#include "backends/file/state.hpp"
#include "core/backend.hpp"
#include "core/backend_loader.hpp"
#include "core/loss_signal.hpp"
#include "core/queue_store.hpp"
#include "core/telemetry.hpp"
#include "core/url.hpp"

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using namespace turnstile::detail;

// The threads of this process now. The first thread started makes a sanitizer's runtime start
// one of its own (TSan's background thread): one is started and joined before counting.
std::size_t thread_count() {
  static const bool runtime_started = [] {
    std::thread([] {}).join();
    return true;
  }();
  (void)runtime_started;
  std::size_t count = 0;
  for (const auto& entry : fs::directory_iterator("/proc/self/task")) {
    (void)entry;
    ++count;
  }
  return count;
}

bool eventually(const std::function<bool()>& predicate, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!predicate()) {
    if (std::chrono::steady_clock::now() >= deadline) return predicate();
    std::this_thread::sleep_for(2ms);
  }
  return true;
}

std::shared_ptr<LossSignal> loss_signal(const std::string& name) {
  return std::make_shared<LossSignal>(name, std::make_shared<const LossSignal::Callbacks>());
}

QueueRequest mutex_request(const std::string& name) {
  QueueRequest request;
  request.name = name;
  return request;
}

// One armed waiter, as the async driver keeps it between its steps.
struct Waiter {
  std::unique_ptr<QueuePlace> place;
  std::unique_ptr<WakeArm> arm;
  std::atomic<bool> woken{false};
};

class FileArm : public ::testing::Test {
 protected:
  // A directory of this process's own (0700, as the backend demands of what it lives in).
  void SetUp() override {
    scratch_ = fs::temp_directory_path() / ("turnstile-file-arm-" + std::to_string(getpid()));
    fs::remove_all(scratch_);
    fs::create_directory(scratch_);
    fs::permissions(scratch_, fs::perms::owner_all);
    url_ = "file://" + scratch_.string() + "/root";
  }
  void TearDown() override { fs::remove_all(scratch_); }
  std::unique_ptr<Backend> connect() const {
    return make_file_backend(parse_url(url_), turnstile::ClientOptions{}, telemetry_.backend_reports());
  }

  // Arms a wake-up for the wait `standing` says this waiter must make.
  void arm(Waiter& waiter, const QueueRequest& request, const Standing& standing) {
    const auto step = next_queue_step(request, standing, true);
    ASSERT_EQ(step.action, QueueStep::Action::wait) << "admitted, though the queue ahead holds";
    waiter.woken = false;
    waiter.arm = waiter.place->arm(step.verdict, {}, [this, &waiter] {
      waiter.woken = true;
      wakes_.fetch_add(1);
    });
  }
  std::unique_ptr<Waiter> join_and_arm(Backend& backend, const QueueRequest& request) {
    auto waiter = std::make_unique<Waiter>();
    Standing first;
    waiter->place = backend.join(request, false, {}, first);
    EXPECT_TRUE(waiter->place);
    if (waiter->place) arm(*waiter, request, first);
    return waiter;
  }
  // A name held, and the waiters armed behind its holder, in join order (the thousand-waiter
  // tests' set-up).
  struct Line {
    std::unique_ptr<Backend> backend;
    QueueRequest request;
    std::unique_ptr<BackendHold> hold;
    std::vector<std::unique_ptr<Waiter>> waiters;
  };
  void hold_name(Line& line, const std::string& name) {
    line.backend = connect();
    line.request = mutex_request(name);
    line.hold = hold_at_once(*line.backend, line.request);
    ASSERT_TRUE(line.hold);
  }
  void queue_armed(Line& line, std::size_t count) {
    for (std::size_t i = 0; i < count; ++i) {
      ASSERT_NO_THROW(line.waiters.push_back(join_and_arm(*line.backend, line.request))) << "waiter " << i;
    }
  }
  // Passes the hold down the line: to waiters[0], then every `step`-th waiter in turn, each woken
  // by the release before it (and the one after it not yet), admitted by its own look; the hold
  // ends as the last one's. `only_they_wake`: no other waiter wakes either (every release wakes
  // exactly one), when no waiter of the line left.
  void admit_in_turn(Line& line, std::size_t step, bool only_they_wake) {
    const auto& waiters = line.waiters;
    const int wakes_before = wakes_.load();
    int released = 0;
    for (std::size_t i = 0; i < waiters.size(); i += step) {
      line.hold->release();
      ++released;
      ASSERT_TRUE(eventually([&] { return waiters[i]->woken.load(); }, 10s)) << "waiter " << i << " never woken";
      if (only_they_wake) {
        ASSERT_EQ(wakes_.load() - wakes_before, released) << "a release woke more than the next waiter";
      }
      line.hold = hold_after_wake(*waiters[i], line.request);
      ASSERT_TRUE(line.hold) << "waiter " << i;
      if (i + step < waiters.size()) {
        ASSERT_FALSE(waiters[i + step]->woken.load()) << "woken out of turn";
      }
    }
  }
  // Joins a free queue and holds at once (nullptr if it was not admitted).
  std::unique_ptr<BackendHold> hold_at_once(Backend& backend, const QueueRequest& request) {
    Standing first;
    auto place = backend.join(request, false, {}, first);
    EXPECT_EQ(next_queue_step(request, first, true).action, QueueStep::Action::hold);
    if (next_queue_step(request, first, true).action != QueueStep::Action::hold) return nullptr;
    return place->hold(loss_signal(request.name));
  }
  // Once woken: disarms, looks, and holds (a look, never the wake, admits).
  std::unique_ptr<BackendHold> hold_after_wake(Waiter& waiter, const QueueRequest& request) {
    waiter.arm.reset();
    const auto step = next_queue_step(request, waiter.place->look({}), true);
    EXPECT_EQ(step.action, QueueStep::Action::hold) << "woken, but not admitted by its look";
    if (step.action != QueueStep::Action::hold) return nullptr;
    return waiter.place->hold(loss_signal(request.name));
  }

  fs::path scratch_;
  std::string url_;
  mutable turnstile::detail::Telemetry telemetry_{"file", false, {}};  // file:// reports nothing
  std::atomic<int> wakes_{0};
};

// First in this file (the first file of the suite), so that it forks before this process has
// any thread. The waiter ahead is another process's entry: a shared watcher thread blocks on its byte for
// us, and the kernel's release at its death wakes the waiter; the waiter behind it waits on
// the first waiter's bytes, woken by this process itself.
TEST_F(FileArm, AHolderKilledInAnotherProcessWakesTheArmedWaiter) {
  int ready[2];
  ASSERT_EQ(pipe2(ready, O_CLOEXEC), 0);
  std::fflush(nullptr);
  const pid_t child = fork();
  if (child == 0) {
    try {
      auto client = turnstile::Client::connect(url_);
      auto mutex = client.mutex("killed");
      mutex.lock();
      if (write(ready[1], "!", 1) != 1) _exit(98);
      for (;;) pause();
    } catch (...) {
    }
    _exit(99);
  }
  ASSERT_GT(child, 0);
  close(ready[1]);
  pollfd pfd{ready[0], POLLIN, 0};
  const bool holds = poll(&pfd, 1, 10000) == 1;
  close(ready[0]);
  const auto reap = [&] {
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
  };
  if (!holds) reap();
  ASSERT_TRUE(holds) << "the child never held the name";
  auto backend = connect();
  const auto request = mutex_request("killed");
  const auto threads_before = thread_count();
  auto first = join_and_arm(*backend, request);
  auto second = join_and_arm(*backend, request);
  EXPECT_LE(thread_count(), threads_before + 1) << "more than one watcher thread for one byte";
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(first->woken.load()) << "woken while the holder lives";
  reap();
  ASSERT_TRUE(eventually([&] { return first->woken.load(); }, 10s)) << "the holder's death woke nobody";
  EXPECT_TRUE(eventually([&] { return thread_count() <= threads_before; }, 5s)) << "the watcher thread stayed";
  auto hold = hold_after_wake(*first, request);
  ASSERT_TRUE(hold);
  EXPECT_FALSE(second->woken.load());
  hold->release();
  ASSERT_TRUE(eventually([&] { return second->woken.load(); }, 10s));
  hold = hold_after_wake(*second, request);
  ASSERT_TRUE(hold);
  hold->release();
}

TEST_F(FileArm, AThousandArmedWaitersOnOneNameAddNoThreadAndAreAdmittedInOrder) {
  constexpr std::size_t kWaiters = 1000;
  Line line;
  ASSERT_NO_FATAL_FAILURE(hold_name(line, "many"));
  const auto threads_before = thread_count();
  ASSERT_NO_FATAL_FAILURE(queue_armed(line, kWaiters));
  const auto threads_armed = thread_count();
  std::printf("threads: %zu before %zu armed waiters, %zu with them\n", threads_before, kWaiters, threads_armed);
  EXPECT_LE(threads_armed, threads_before + 2) << "a thread per armed waiter";
  EXPECT_EQ(wakes_.load(), 0) << "woken with the name still held";
  ASSERT_NO_FATAL_FAILURE(admit_in_turn(line, 1, true));
  EXPECT_LE(thread_count(), threads_before + 2);
  line.hold->release();
}

// The open descriptors of this process now.
std::size_t open_descriptors() {
  std::size_t count = 0;
  for (const auto& entry : fs::directory_iterator("/proc/self/fd")) {
    (void)entry;
    ++count;
  }
  return count;
}

// Lowers the soft limit on descriptors for a test's duration.
class DescriptorLimit {
 public:
  explicit DescriptorLimit(rlim_t soft) {
    getrlimit(RLIMIT_NOFILE, &saved_);
    rlimit lowered = saved_;
    lowered.rlim_cur = std::min(soft, saved_.rlim_cur);
    set_ = setrlimit(RLIMIT_NOFILE, &lowered) == 0;
  }
  ~DescriptorLimit() { setrlimit(RLIMIT_NOFILE, &saved_); }
  bool set() const { return set_; }

 private:
  rlimit saved_{};
  bool set_ = false;
};

// Whether every entry in the queue of `name`'s state file has its life byte locked, seen from a
// description of the test's own (the kernel's word, not the backend's bookkeeping).
bool every_entry_alive(const fs::path& root, const std::string& name, std::size_t& entries) {
  const int fd = open((root / ("n." + name + ".s")).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  file_state::Header header{};
  const bool read_whole = pread(fd, &header, sizeof header, 0) == static_cast<ssize_t>(sizeof header);
  bool alive = read_whole;
  entries = read_whole ? header.count : 0;
  for (std::size_t i = 0; alive && i < header.count; ++i) {
    file_state::Slot slot{};
    alive = pread(fd, &slot, sizeof slot, static_cast<off_t>(file_state::kSlotsOffset + i * sizeof slot)) ==
                static_cast<ssize_t>(sizeof slot) &&
            file_state::is_locked(fd, file_state::byte_offset(slot.seq, file_state::Byte::life), 1);
  }
  close(fd);
  return alive;
}

// Issue 26 round 2: waiting entries of one process share one open file description for their
// lock bytes (each locks its own bytes on it), so the waiters on a name cost no descriptor each:
// 1,000 armed waiters fit under a soft limit of 100 descriptors above those open before (each
// had a description of its own before: a typed error at the limit). Half of them leave out of
// order: the others' bytes stay locked, and the rest are admitted in order.
TEST_F(FileArm, ArmedWaitersOfOneProcessShareOneDescription) {
  constexpr std::size_t kWaiters = 1000;
  Line line;
  ASSERT_NO_FATAL_FAILURE(hold_name(line, "many"));
  const auto& request = line.request;
  const auto& waiters = line.waiters;
  const auto descriptors_before = open_descriptors();
  {
    DescriptorLimit limit(descriptors_before + 100);
    ASSERT_TRUE(limit.set());
    ASSERT_NO_FATAL_FAILURE(queue_armed(line, kWaiters));
  }
  std::printf("descriptors: %zu before %zu armed waiters, %zu with them\n", descriptors_before, kWaiters,
              open_descriptors());
  EXPECT_LE(open_descriptors(), descriptors_before + 4) << "a descriptor per waiting entry";
  for (std::size_t i = 1; i < kWaiters; i += 2) waiters[i]->place->leave();
  std::size_t entries = 0;
  EXPECT_TRUE(every_entry_alive(scratch_ / "root", request.name, entries)) << "a leave dropped others' bytes";
  EXPECT_EQ(entries, 1 + kWaiters / 2);
  for (std::size_t i = 2; i < kWaiters; i += 2) {  // each waited on the one that left: it looks again
    ASSERT_TRUE(eventually([&] { return waiters[i]->woken.load(); }, 10s)) << "waiter " << i;
    waiters[i]->arm.reset();
    arm(*waiters[i], request, waiters[i]->place->look({}));
  }
  // (The waiters that left keep their arms, on the entry ahead of each: its release wakes them too.)
  ASSERT_NO_FATAL_FAILURE(admit_in_turn(line, 2, false));
  line.hold->release();
  EXPECT_TRUE(every_entry_alive(scratch_ / "root", request.name, entries));
  EXPECT_EQ(entries, 0u);
}

// Destroying an arm disarms it: once the destructor has returned the wake never runs, however
// the release ahead races it; on both paths, a holder of this client (told by its entry) and
// one of another client in this process (watched through the kernel, on a watcher thread).
TEST_F(FileArm, AnArmDestroyedWhileTheEntryAheadLeavesNeverWakesAfterward) {
  auto backend = connect();
  auto other_client = connect();
  const auto request = mutex_request("race");
  for (int round = 0; round < 200; ++round) {
    Backend& holders = round % 2 == 0 ? *backend : *other_client;
    Standing first;
    auto holder_place = holders.join(request, false, {}, first);
    ASSERT_EQ(next_queue_step(request, first, true).action, QueueStep::Action::hold);
    auto hold = holder_place->hold(loss_signal(request.name));
    ASSERT_TRUE(hold);
    Standing waiting;
    auto place = backend->join(request, false, {}, waiting);
    const auto step = next_queue_step(request, waiting, true);
    ASSERT_EQ(step.action, QueueStep::Action::wait);
    std::atomic<bool> disarmed{false};
    std::atomic<int> late{0};
    auto armed = place->arm(step.verdict, {}, [&] {
      if (disarmed.load()) late.fetch_add(1);
    });
    std::thread releaser([&] { hold->release(); });
    armed.reset();
    disarmed = true;
    releaser.join();
    place->leave();
    ASSERT_EQ(late.load(), 0) << "woken after its arm was destroyed (round " << round << ")";
  }
}

// A semaphore's waiters: the first waits for any holder ahead to leave, the others for the
// admission of the one just ahead (its waiting byte); all armed, all local.
TEST_F(FileArm, ArmedLeaseWaitersAreAdmittedAsHoldersLeave) {
  auto backend = connect();
  QueueRequest request = mutex_request("pool");
  request.kind = EntryKind::lease;
  request.primitive = Primitive::semaphore;
  request.limit = 2;
  std::vector<std::unique_ptr<BackendHold>> holds;
  for (int i = 0; i < 2; ++i) {
    Standing first;
    auto place = backend->join(request, false, {}, first);
    ASSERT_EQ(next_queue_step(request, first, true).action, QueueStep::Action::hold);
    holds.push_back(place->hold(loss_signal(request.name)));
  }
  const auto threads_before = thread_count();
  std::vector<std::unique_ptr<Waiter>> waiters;
  for (int i = 0; i < 20; ++i) waiters.push_back(join_and_arm(*backend, request));
  EXPECT_LE(thread_count(), threads_before + 1);
  for (std::size_t i = 0; i < waiters.size(); ++i) {
    holds.front()->release();
    holds.erase(holds.begin());
    ASSERT_TRUE(eventually([&] { return waiters[i]->woken.load(); }, 10s)) << "lease waiter " << i;
    holds.push_back(hold_after_wake(*waiters[i], request));
    ASSERT_TRUE(holds.back());
    if (i + 1 < waiters.size()) {
      // The next one was woken by this admission (its predecessor's waiting byte): it waits on.
      ASSERT_TRUE(eventually([&] { return waiters[i + 1]->woken.load(); }, 10s)) << "lease waiter " << i + 1;
      waiters[i + 1]->arm.reset();
      arm(*waiters[i + 1], request, waiters[i + 1]->place->look({}));
    }
  }
  EXPECT_LE(thread_count(), threads_before + 1);
}

// PermitCounter: the first in line sleeps on the futex word (a thread of its own), every other
// waiter on its predecessor's entry, woken by it as it takes its permits and leaves.
TEST_F(FileArm, ArmedCounterWaitersTakeInTurn) {
  constexpr int kWaiters = 100;
  auto backend = connect();
  const std::string name = "counter";
  struct CounterWaiter {
    std::unique_ptr<CounterLine> line;
    std::unique_ptr<WakeArm> arm;
    std::atomic<bool> woken{false};
  };
  const auto arm_counter = [&](CounterWaiter& waiter) {
    auto standing = waiter.line->look(false, {});
    ASSERT_FALSE(standing.taken);
    if (!standing.in_line) {
      waiter.line->join({});
      standing = waiter.line->look(false, {});
      ASSERT_FALSE(standing.taken);
    }
    const auto wait = evaluate_counter_line(standing.ahead, standing.value, 1);
    ASSERT_NE(wait, CounterWait::nothing);
    waiter.woken = false;
    waiter.arm = waiter.line->arm(wait, {}, [&waiter] { waiter.woken = true; });
  };
  const auto threads_before = thread_count();
  std::vector<std::unique_ptr<CounterWaiter>> waiters;
  for (int i = 0; i < kWaiters; ++i) {
    waiters.push_back(std::make_unique<CounterWaiter>());
    waiters.back()->line = backend->counter_line(name, 1, {});
    arm_counter(*waiters.back());
  }
  EXPECT_LE(thread_count(), threads_before + 2) << "a thread per armed counter waiter";
  for (int i = 0; i < kWaiters; ++i) {
    EXPECT_FALSE(waiters[i]->woken.load()) << "woken before its permit was added";
    backend->counter_add(name, 1);
    ASSERT_TRUE(eventually([&] { return waiters[i]->woken.load(); }, 10s)) << "counter waiter " << i;
    waiters[i]->arm.reset();
    ASSERT_TRUE(waiters[i]->line->look(false, {}).taken) << "counter waiter " << i;
    if (i + 1 < kWaiters) {
      ASSERT_TRUE(eventually([&] { return waiters[i + 1]->woken.load(); }, 10s)) << "counter waiter " << i + 1;
      waiters[i + 1]->arm.reset();
      arm_counter(*waiters[i + 1]);  // first in line now: the value
    }
  }
  EXPECT_LE(thread_count(), threads_before + 2);
}

}  // namespace
