// SPDX-License-Identifier: Apache-2.0
// The hold-history checker must itself be right: hand-made histories that must pass and
// histories that must fail, plus the recorders and the file format.
#include "testing/hold_history.hpp"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

namespace th = turnstile::testing;
using th::HoldRecord;

namespace {

HoldRecord ex(std::uint64_t token, std::int64_t start, std::int64_t end, std::string name = "n") {
  return {std::move(name), "exclusive", 1, token, start, end};
}
HoldRecord sh(std::uint64_t token, std::int64_t start, std::int64_t end, std::string name = "n") {
  return {std::move(name), "shared", 1, token, start, end};
}
HoldRecord lease(std::uint64_t token, std::int64_t start, std::int64_t end, std::int64_t permits = 1,
                 std::string name = "n") {
  return {std::move(name), "lease", permits, token, start, end};
}

// The same record, asked for at `at`.
HoldRecord asked(HoldRecord record, std::int64_t at) {
  record.request_ns = at;
  return record;
}

bool mentions(const std::vector<std::string>& violations, const std::string& text) {
  for (const auto& v : violations) {
    if (v.find(text) != std::string::npos) return true;
  }
  return false;
}

#define EXPECT_SOUND(records, ...)                                 \
  do {                                                             \
    const auto violations_ = th::check(records, ##__VA_ARGS__);    \
    EXPECT_TRUE(violations_.empty()) << th::describe(violations_); \
  } while (0)

std::string temp_path(const std::string& leaf) {
  char dir[] = "/tmp/turnstile-history-XXXXXX";
  if (!mkdtemp(dir)) std::abort();
  return std::string(dir) + "/" + leaf;
}

}  // namespace

TEST(HoldHistory, EmptyHistoryIsSound) {
  EXPECT_SOUND(std::vector<HoldRecord>{});
  EXPECT_EQ(th::max_concurrency({}), 0);
}

TEST(HoldHistory, SuccessiveExclusiveHoldsPass) {
  EXPECT_SOUND((std::vector{ex(1, 0, 10), ex(2, 20, 30), ex(5, 31, 40)}));
}

TEST(HoldHistory, TouchingIntervalsDoNotOverlap) {
  EXPECT_SOUND((std::vector{ex(1, 0, 10), ex(2, 10, 20), sh(3, 20, 30), ex(4, 30, 40)}));
}

TEST(HoldHistory, OverlappingExclusiveHoldsFail) {
  const auto v = th::check({ex(1, 0, 10), ex(2, 9, 20)});
  ASSERT_EQ(v.size(), 1u) << th::describe(v);
  EXPECT_TRUE(mentions(v, "two exclusive holds overlap")) << th::describe(v);
  EXPECT_TRUE(mentions(v, "by 1 ns")) << th::describe(v);
}

TEST(HoldHistory, ExclusiveHoldInsideAnotherFails) {
  const auto v = th::check({ex(1, 0, 100), ex(2, 40, 50)});
  EXPECT_TRUE(mentions(v, "two exclusive holds overlap")) << th::describe(v);
}

TEST(HoldHistory, DifferentNamesAreIndependent) {
  EXPECT_SOUND((std::vector{ex(1, 0, 10, "a"), ex(1, 5, 15, "b"), ex(2, 20, 30, "a")}));
}

TEST(HoldHistory, ReadersMayOverlap) {
  EXPECT_SOUND((std::vector{sh(1, 0, 100), sh(2, 10, 50), sh(3, 20, 120), ex(4, 121, 130)}));
}

TEST(HoldHistory, WriterOverlappingReaderFails) {
  for (const auto& history : {std::vector{ex(1, 0, 10), sh(2, 5, 20)}, std::vector{sh(1, 0, 10), ex(2, 5, 20)}}) {
    const auto v = th::check(history);
    EXPECT_TRUE(mentions(v, "a writer overlaps another holder")) << th::describe(v);
  }
}

TEST(HoldHistory, WriterOverlappingLeaseFails) {
  const auto v = th::check({lease(1, 0, 10), ex(2, 5, 20)}, 5);
  EXPECT_TRUE(mentions(v, "a writer overlaps another holder")) << th::describe(v);
}

TEST(HoldHistory, DowngradeIsOneEntry) {
  // Writer token 7 takes the read lock at 5 and drops the write lock at 10, reads until 20;
  // a reader joins after the downgrade, a writer only after every reader left.
  EXPECT_SOUND((std::vector{ex(7, 0, 10), sh(7, 5, 20), sh(8, 12, 18), ex(9, 21, 30)}));
}

TEST(HoldHistory, SameTokenReaderBeforeTheWriterIsNoDowngrade) {
  const auto v = th::check({sh(7, 0, 10), ex(7, 5, 20)});
  EXPECT_TRUE(mentions(v, "a writer overlaps another holder")) << th::describe(v);
}

TEST(HoldHistory, LeasesWithinTheLimitPass) {
  const std::vector history{lease(1, 0, 100), lease(2, 10, 90), lease(3, 20, 80), lease(4, 100, 120)};
  EXPECT_SOUND(history, 3);
  EXPECT_EQ(th::max_concurrency(history), 3);
}

TEST(HoldHistory, LeasesOverTheLimitFail) {
  const std::vector history{lease(1, 0, 100), lease(2, 10, 90), lease(3, 20, 80), lease(4, 30, 40)};
  const auto v = th::check(history, 3);
  ASSERT_EQ(v.size(), 1u) << th::describe(v);
  EXPECT_TRUE(mentions(v, "4 lease permits held at once")) << th::describe(v);
  EXPECT_TRUE(mentions(v, "the limit is 3")) << th::describe(v);
  EXPECT_EQ(th::max_concurrency(history), 4);
}

TEST(HoldHistory, LeasePermitsAreSummed) {
  const std::vector history{lease(1, 0, 100, 2), lease(2, 10, 90, 2)};
  EXPECT_FALSE(th::check(history, 3).empty());
  EXPECT_SOUND(history, 4);
  EXPECT_EQ(th::max_concurrency(history), 4);
}

TEST(HoldHistory, EveryExcursionOverTheLimitIsReported) {
  const std::vector history{lease(1, 0, 10), lease(2, 5, 15), lease(3, 20, 30), lease(4, 25, 35)};
  EXPECT_EQ(th::check(history, 1).size(), 2u);
}

TEST(HoldHistory, NoLimitMeansLeasesAreNotCounted) {
  EXPECT_SOUND((std::vector{lease(1, 0, 100), lease(2, 10, 90), lease(3, 20, 80)}));
  EXPECT_SOUND((std::vector{lease(1, 0, 100), lease(2, 10, 90), lease(3, 20, 80)}), 0);
}

TEST(HoldHistory, LimitPerName) {
  const std::vector history{lease(1, 0, 100, 1, "small"), lease(2, 10, 90, 1, "small"), lease(1, 0, 100, 1, "big"),
                            lease(2, 10, 90, 1, "big")};
  const auto v = th::check(history, [](const std::string& name) { return name == "small" ? 1 : 2; });
  ASSERT_EQ(v.size(), 1u) << th::describe(v);
  EXPECT_TRUE(mentions(v, "'small'")) << th::describe(v);
  EXPECT_EQ(th::max_concurrency(history, "big"), 2);
  EXPECT_EQ(th::max_concurrency(history, "nobody"), 0);
}

TEST(HoldHistory, ExclusiveTokensMustIncreaseWithStartTime) {
  const auto v = th::check({ex(5, 0, 10), ex(4, 20, 30)});
  EXPECT_TRUE(mentions(v, "fencing token does not increase")) << th::describe(v);
}

TEST(HoldHistory, ExclusiveTokensMustBeUnique) {
  const auto v = th::check({ex(5, 0, 10), ex(5, 20, 30)});
  EXPECT_TRUE(mentions(v, "given to two exclusive holds")) << th::describe(v);
}

TEST(HoldHistory, HoldAfterAnEndedWriterNeedsAGreaterToken) {
  EXPECT_TRUE(mentions(th::check({ex(5, 0, 10), sh(3, 20, 30)}), "fencing token does not increase"));
  EXPECT_TRUE(mentions(th::check({sh(5, 0, 10), ex(3, 20, 30)}), "fencing token does not increase"));
  EXPECT_TRUE(mentions(th::check({ex(5, 0, 10), sh(5, 20, 30)}), "fencing token does not increase"));
  EXPECT_SOUND((std::vector{ex(5, 0, 10), sh(6, 20, 30), ex(7, 31, 40)}));
}

TEST(HoldHistory, ReaderThatWokeLateIsNoFencingViolation) {
  // Reader 4 was admitted first but returned from lock_shared() only after reader 7 (admitted
  // just behind it) had come and gone: recorded starts cannot tell, so this is allowed...
  EXPECT_SOUND((std::vector{asked(sh(7, 10, 20), 5), asked(sh(4, 25, 30), 1)}));
  EXPECT_SOUND((std::vector{asked(lease(7, 10, 20), 5), asked(lease(4, 25, 30), 1)}), 1);
  // ...and so is a record without a request time.
  EXPECT_SOUND((std::vector{sh(7, 10, 20), sh(4, 25, 30)}));
}

TEST(HoldHistory, ReaderRequestedAfterAnEndedHoldNeedsAGreaterToken) {
  EXPECT_TRUE(mentions(th::check({sh(5, 0, 10), asked(sh(3, 20, 30), 15)}), "was requested after"));
  EXPECT_TRUE(mentions(th::check({sh(5, 0, 10), asked(sh(5, 20, 30), 11)}), "was requested after"));
  EXPECT_SOUND((std::vector{sh(5, 0, 10), asked(sh(6, 20, 30), 11)}));
  // Asked before the other ended: no order is implied.
  EXPECT_SOUND((std::vector{sh(5, 0, 10), asked(sh(3, 20, 30), 9)}));
}

TEST(HoldHistory, OverlappingReadersAndLeasesMayHoldAnyTokenOrder) {
  // The later starter has the smaller token, but the first was still holding: allowed.
  EXPECT_SOUND((std::vector{sh(5, 0, 100), asked(sh(3, 20, 30), 1)}));
  EXPECT_SOUND((std::vector{lease(5, 0, 100), asked(lease(3, 20, 30), 1)}), 2);
}

TEST(HoldHistory, LeaseRequestedAfterAnEndedLeaseNeedsAGreaterToken) {
  const auto v = th::check({lease(9, 0, 10), lease(2, 5, 50), asked(lease(8, 20, 30), 15)}, 2);
  ASSERT_EQ(v.size(), 1u) << th::describe(v);
  EXPECT_TRUE(mentions(v, "token 8")) << th::describe(v);
  EXPECT_TRUE(mentions(v, "token 9")) << th::describe(v);
}

TEST(HoldHistory, MalformedRecordsAreReported) {
  EXPECT_TRUE(mentions(th::check({ex(1, 10, 5)}), "ends before it starts"));
  EXPECT_TRUE(mentions(th::check({HoldRecord{"n", "weird", 1, 1, 0, 1}}), "unknown kind"));
  EXPECT_TRUE(mentions(th::check({lease(1, 0, 1, 0)}), "0 permits"));
  EXPECT_TRUE(mentions(th::check({HoldRecord{"n", "exclusive", 2, 1, 0, 1}}), "lock hold with 2 permits"));
  EXPECT_TRUE(mentions(th::check({asked(ex(1, 10, 20), 11)}), "after it started"));
}

TEST(HoldHistory, ReportsAreCapped) {
  std::vector<HoldRecord> history;
  for (int i = 0; i < 100; ++i) history.push_back(ex(static_cast<std::uint64_t>(i + 1), 0, 1000));
  const auto v = th::check(history);
  EXPECT_LT(v.size(), 100u);
  EXPECT_TRUE(mentions(v, "more exclusive-overlap violations")) << th::describe(v);
}

TEST(HoldHistory, InstantsOverlapOnlyWhatStrictlyContainsThem) {
  // A hold recorded as one instant overlaps the holds around it, not those touching it.
  const std::vector touching{lease(1, 0, 10), lease(2, 10, 10), lease(3, 20, 20), lease(4, 20, 30)};
  EXPECT_SOUND(touching, 1);
  EXPECT_EQ(th::max_concurrency(touching), 1);
  const std::vector inside{lease(1, 0, 10), lease(2, 5, 5)};
  EXPECT_FALSE(th::check(inside, 1).empty());
  EXPECT_EQ(th::max_concurrency(inside), 2);
  EXPECT_SOUND((std::vector{ex(1, 0, 10), ex(2, 10, 10), ex(3, 10, 20)}));
  EXPECT_FALSE(th::check({ex(1, 0, 10), ex(2, 5, 5)}).empty());
}

TEST(HoldHistory, MaxConcurrencyCountsLockHoldsAsOne) {
  EXPECT_EQ(th::max_concurrency({sh(1, 0, 10), sh(2, 5, 15), sh(3, 9, 20), ex(4, 20, 30)}), 3);
  EXPECT_EQ(th::max_concurrency({ex(1, 0, 10), ex(2, 10, 20)}), 1);
}

TEST(HoldHistory, RecorderIsThreadSafe) {
  th::HoldRecorder recorder;
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&recorder, t] {
      for (int i = 0; i < 1000; ++i) {
        recorder.record(ex(static_cast<std::uint64_t>(t * 1000 + i), i, i + 1));
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(recorder.size(), 8000u);
  EXPECT_EQ(recorder.records().size(), 8000u);
  recorder.clear();
  EXPECT_EQ(recorder.size(), 0u);
}

TEST(HoldHistory, MonotonicClockAdvances) {
  const auto a = th::monotonic_ns();
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  const auto b = th::monotonic_ns();
  EXPECT_GE(b - a, 2'000'000);
}

TEST(HoldHistory, LineFormatRoundTripsAnyName) {
  const HoldRecord original{
      "we ird/na\tme%20{x}/\xC3\xBC\xE6\x97\xA5\n", "lease", 3, 18446744073709551615ULL, -5, 9223372036854775807LL, -7};
  const auto line = th::format_line(original);
  EXPECT_EQ(std::count(line.begin(), line.end(), '\n'), 1);
  EXPECT_EQ(line.back(), '\n');
  const auto back = th::parse_line(line);
  EXPECT_EQ(back.name, original.name);
  EXPECT_EQ(back.kind, original.kind);
  EXPECT_EQ(back.permits, original.permits);
  EXPECT_EQ(back.token, original.token);
  EXPECT_EQ(back.start_ns, original.start_ns);
  EXPECT_EQ(back.end_ns, original.end_ns);
  EXPECT_EQ(back.request_ns, original.request_ns);
}

TEST(HoldHistory, MalformedLinesAreRejected) {
  EXPECT_THROW(th::parse_line("garbage"), std::invalid_argument);
  EXPECT_NO_THROW(th::parse_line("h1\texclusive\t1\t1\t0\t1\t0\tn"));
  EXPECT_THROW(th::parse_line("h1\texclusive\t1\tx\t0\t1\t0\tn"), std::invalid_argument);
  EXPECT_THROW(th::parse_line("h1\texclusive\t1\t1\t0\t1\t0\tn%4"), std::invalid_argument);
  EXPECT_THROW(th::parse_line("h1\texclusive\t1\t1\t0\t1\tn"), std::invalid_argument);
  EXPECT_THROW(th::parse_line("h1\texclusive\t1\t1\t0\t1\t0\tn\textra"), std::invalid_argument);
}

TEST(HoldHistory, MissingFileIsAnEmptyHistory) {
  EXPECT_TRUE(th::load_history("/nonexistent/turnstile/history").empty());
}

TEST(HoldHistory, LoadReportsTheBadLine) {
  const auto path = temp_path("bad");
  {
    std::ofstream out(path);
    out << th::format_line(ex(1, 0, 1)) << "oops\n";
  }
  try {
    th::load_history(path);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find(":2:"), std::string::npos) << error.what();
  }
  std::filesystem::remove_all(std::filesystem::path(path).parent_path());
}

TEST(HoldHistory, FileRecorderLinesOfConcurrentProcessesDoNotInterleave) {
  const auto path = temp_path("history");
  constexpr int kChildren = 4;
  constexpr int kPerChild = 500;
  const std::string long_name(200, 'x');
  std::vector<pid_t> children;
  for (int c = 0; c < kChildren; ++c) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int status = 0;
      try {
        th::FileHoldRecorder recorder(path);
        for (int i = 0; i < kPerChild; ++i) {
          recorder.record(ex(static_cast<std::uint64_t>(c * kPerChild + i + 1), i, i + 1, long_name));
        }
      } catch (...) {
        status = 1;
      }
      _exit(status);
    }
    children.push_back(pid);
  }
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  const auto records = th::load_history(path);
  ASSERT_EQ(records.size(), static_cast<std::size_t>(kChildren * kPerChild));
  std::set<std::uint64_t> tokens;
  for (const auto& r : records) {
    EXPECT_EQ(r.name, long_name);
    tokens.insert(r.token);
  }
  EXPECT_EQ(tokens.size(), records.size());
  std::filesystem::remove_all(std::filesystem::path(path).parent_path());
}

TEST(HoldHistory, FileRecorderAppendsToAnExistingHistory) {
  const auto path = temp_path("history");
  {
    th::FileHoldRecorder recorder(path);
    recorder.record(ex(1, 0, 10));
  }
  {
    th::FileHoldRecorder recorder(path);
    recorder.record(ex(2, 5, 15));
  }
  const auto records = th::load_history(path);
  ASSERT_EQ(records.size(), 2u);
  EXPECT_FALSE(th::check(records).empty());  // the two overlap
  std::filesystem::remove_all(std::filesystem::path(path).parent_path());
}

TEST(HoldHistory, FileRecorderReportsAnUnwritablePath) {
  EXPECT_THROW(th::FileHoldRecorder("/nonexistent/dir/history"), std::system_error);
}
