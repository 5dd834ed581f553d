// SPDX-License-Identifier: Apache-2.0
// Fencing tokens strictly increase for successive holders of a name: threads, clients,
// processes, every kind of hold.
#include <algorithm>
#include <future>
#include <map>
#include <mutex>
#include <shared_mutex>

#include "conformance/support.hpp"

namespace conformance {
namespace {
using turnstile::Client;
}

TEST_P(Conformance, FencingTokensIncreaseForSuccessiveHolds) {
  auto mutex = client().mutex(name("x"));
  auto other = connect();
  auto shared = other.shared_mutex(name("x"));
  std::uint64_t last = 0;
  const auto next = [&](std::uint64_t token, const char* what) {
    EXPECT_GT(token, last) << what;
    last = token;
  };
  for (int i = 0; i < 3; ++i) {
    mutex.lock();
    next(mutex.fencing_token(), "mutex");
    mutex.unlock();
    shared.lock_shared();
    next(shared.fencing_token(), "reader");
    shared.unlock_shared();
    shared.lock();
    next(shared.fencing_token(), "writer");
    shared.unlock();
  }
  auto semaphore = client().semaphore(name("s"), 2);
  last = 0;
  for (int i = 0; i < 3; ++i) {
    auto lease = semaphore.acquire();
    next(lease.fencing_token(), "lease");
  }
}

TEST_P(Conformance, FencingTokensIncreaseAcrossThreads) {
  const auto lock_name = name("x");
  th::HoldRecorder recorder;
  run_threads(5, [&](int t) {
    auto own = connect();
    auto mutex = own.mutex(lock_name);
    auto shared = own.shared_mutex(lock_name);
    for (int i = 0; i < 12; ++i) {
      if ((i + t) % 4 == 0) {
        Stopwatch watch;
        std::shared_lock guard(shared);
        watch.held();
        recorder.record(watch.finish(lock_name, "shared", 1, shared.fencing_token()));
      } else {
        Stopwatch watch;
        std::lock_guard guard(mutex);
        watch.held();
        recorder.record(watch.finish(lock_name, "exclusive", 1, mutex.fencing_token()));
      }
    }
  });
  expect_sound(recorder.records());
}

TEST_P(Conformance, FencingTokensIncreaseAcrossProcesses) {
  const auto lock_name = name("x");
  const auto sem_name = name("s");
  const auto history = scratch_path("history");
  const auto hold_in_child = [&] {
    return Child::spawn_gated([&] {
      auto own = Client::connect(url());
      th::FileHoldRecorder recorder(history);
      auto mutex = own.mutex(lock_name);
      {
        Stopwatch watch;
        std::lock_guard guard(mutex);
        watch.held();
        recorder.record(watch.finish(lock_name, "exclusive", 1, mutex.fencing_token()));
      }
      Stopwatch watch;
      auto lease = own.semaphore(sem_name, 1).acquire();
      watch.held();
      recorder.record(watch.finish(sem_name, "lease", 1, lease.fencing_token()));
      return 0;
    });
  };
  std::vector<Child> children;  // forked before this process has any background thread
  for (int round = 0; round < 3; ++round) children.push_back(hold_in_child());
  th::FileHoldRecorder recorder(history);
  auto mutex = client().mutex(lock_name);
  auto semaphore = client().semaphore(sem_name, 1);
  for (int round = 0; round < 3; ++round) {
    {
      Stopwatch watch;
      std::lock_guard guard(mutex);
      watch.held();
      recorder.record(watch.finish(lock_name, "exclusive", 1, mutex.fencing_token()));
    }
    {
      Stopwatch watch;
      auto lease = semaphore.acquire();
      watch.held();
      recorder.record(watch.finish(sem_name, "lease", 1, lease.fencing_token()));
    }
    auto& child = children[static_cast<std::size_t>(round)];
    child.start();
    EXPECT_EQ(child.wait(), 0);
  }
  const auto records = th::load_history(history);
  EXPECT_EQ(records.size(), 12u);
  expect_sound(records, 1);
  // Strictly increasing in the order the holds happened (they were all sequential).
  std::map<std::string, std::uint64_t> last;
  auto sorted = records;
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.start_ns < b.start_ns; });
  for (const auto& r : sorted) {
    EXPECT_GT(r.token, last[r.name]) << r.name;
    last[r.name] = r.token;
  }
}

TEST_P(Conformance, FencingTokensAreVisibleInInspect) {
  auto mutex = client().mutex(name("m"));
  mutex.lock();
  const auto inspection = client().inspect(name("m"));
  EXPECT_EQ(inspection.name, name("m"));
  EXPECT_EQ(inspection.mode, "lock");
  ASSERT_EQ(inspection.holders.size(), 1u);
  EXPECT_EQ(inspection.holders[0].fencing_token, mutex.fencing_token());
  EXPECT_EQ(inspection.holders[0].kind, "exclusive");
  EXPECT_TRUE(inspection.holders[0].holding);
  EXPECT_TRUE(inspection.waiters.empty());
  mutex.unlock();
  const auto after = client().inspect(name("m"));
  EXPECT_TRUE(after.holders.empty());
  EXPECT_EQ(after.mode, "");
}

// ClientOptions::holder_label is kept with every entry, holder or waiter, of every primitive,
// and shown by inspect exactly (spaces and text that looks like the entry's own fields
// included); an unlabelled client's entries have none.
TEST_P(Conformance, HolderLabelsAreKeptWithEveryEntry) {
  const std::string label = "nightly report kind=shared permits=7 label=x pid=1 \xc3\xa9t\xc3\xa9";
  turnstile::ClientOptions labelled_options;
  labelled_options.holder_label = label;
  auto labelled = connect(labelled_options);
  auto mutex = labelled.mutex(name("m"));
  mutex.lock();
  auto unlabelled = connect();
  auto waiting_mutex = unlabelled.mutex(name("m"));
  auto waited = std::async(std::launch::async, [&] {
    waiting_mutex.lock();
    waiting_mutex.unlock();
  });
  OnExit let_go([&] {
    if (mutex.owns_lock()) mutex.unlock();
  });
  ASSERT_TRUE(wait_for_waiters(name("m"), 1));
  auto seen = client().inspect(name("m"));
  ASSERT_EQ(seen.holders.size(), 1u);
  EXPECT_EQ(seen.holders[0].label, label);
  EXPECT_EQ(seen.holders[0].permits, 1);
  EXPECT_EQ(seen.holders[0].kind, "exclusive");
  ASSERT_EQ(seen.waiters.size(), 1u);
  EXPECT_EQ(seen.waiters[0].label, "");
  mutex.unlock();
  ASSERT_EQ(waited.wait_for(20s), std::future_status::ready);

  auto lease = labelled.semaphore(name("sem"), 5).acquire(2);
  seen = client().inspect(name("sem"));
  ASSERT_EQ(seen.holders.size(), 1u);
  EXPECT_EQ(seen.holders[0].label, label);
  EXPECT_EQ(seen.holders[0].permits, 2);
  lease.release();

  auto shared = labelled.shared_mutex(name("rw"));
  shared.lock();
  shared.lock_shared();
  shared.unlock();  // downgraded: the entry is rewritten as a reader's
  seen = client().inspect(name("rw"));
  ASSERT_EQ(seen.holders.size(), 1u);
  EXPECT_EQ(seen.holders[0].label, label);
  EXPECT_EQ(seen.holders[0].kind, "shared");
  shared.unlock_shared();
}

// Red team: inspect shows a downgraded writer with the token its hold has (Consul showed the
// ModifyIndex of the downgrade's rewrite instead).
TEST_P(Conformance, ADowngradedWriterShowsTheTokenItHolds) {
  auto rw = client().shared_mutex(name("rw"));
  rw.lock();
  const auto token = rw.fencing_token();
  rw.lock_shared();
  rw.unlock();  // downgraded
  ASSERT_EQ(rw.fencing_token(), token);
  const auto seen = connect().inspect(name("rw"));
  ASSERT_EQ(seen.holders.size(), 1u);
  EXPECT_EQ(seen.holders[0].kind, "shared");
  EXPECT_EQ(seen.holders[0].fencing_token, token);
  rw.unlock_shared();
}

}  // namespace conformance
