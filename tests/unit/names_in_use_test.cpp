// SPDX-License-Identifier: Apache-2.0
// Client::names_in_use over a backend that answers as told (core/names_in_use.hpp): candidates
// filtered, sorted and counted by inspect, a few hundred per inspect_each, and `truncated` only
// when more names may be in use. No server involved.
#include "core/names_in_use.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "turnstile/error.hpp"

namespace {

using namespace std::chrono_literals;
using namespace turnstile::detail;

// Proposes `candidates`; a name in `in_use` has that many holders and waiters, others none.
class ListedBackend final : public Backend {
 public:
  std::vector<std::string> candidates;
  bool complete = true;
  std::map<std::string, std::pair<std::size_t, std::size_t>> in_use;
  std::vector<std::size_t> batches;  // the size of each inspect_each

  QueueNames queue_names(const std::string&, std::size_t, turnstile::Deadline) override {
    return {candidates, complete};
  }
  std::vector<turnstile::Inspection> inspect_each(const std::vector<std::string>& names,
                                                  turnstile::Deadline deadline) override {
    batches.push_back(names.size());
    return Backend::inspect_each(names, deadline);
  }
  turnstile::Inspection inspect(const std::string& name, turnstile::Deadline) override {
    turnstile::Inspection queue;
    queue.name = name;
    if (const auto found = in_use.find(name); found != in_use.end()) {
      queue.mode = "lock";
      queue.holders.resize(found->second.first);
      queue.waiters.resize(found->second.second);
    }
    return queue;
  }
  std::unique_ptr<QueuePlace> join(const QueueRequest&, bool, turnstile::Deadline, Standing&) override {
    throw turnstile::BackendUnavailable("not in this test");
  }
  std::unique_ptr<CounterLine> counter_line(const std::string&, std::int64_t, const std::stop_token&) override {
    throw turnstile::BackendUnavailable("not in this test");
  }
  bool counter_try_set(const std::string&, std::int64_t) override { return false; }
  std::int64_t counter_add(const std::string&, std::int64_t) override { return 0; }
  std::optional<std::int64_t> counter_get(const std::string&) override { return std::nullopt; }
  std::int64_t counter_drain(const std::string&) override { return 0; }
};

std::vector<std::string> names_of(const turnstile::NamesInUse& listed) {
  std::vector<std::string> names;
  for (const auto& n : listed.names) names.push_back(n.name);
  return names;
}

const auto kSoon = std::chrono::steady_clock::now() + 60s;

TEST(NamesInUse, ListsTheNamesInUseInOrderOnceEachWithTheirCounts) {
  ListedBackend backend;
  backend.candidates = {"jobs/b", "jobs/a", "other", "jobs/a", "jobs//bad", "jobs/idle"};
  backend.in_use = {{"jobs/a", {1, 2}}, {"jobs/b", {0, 1}}, {"other", {1, 0}}, {"jobs//bad", {1, 0}}};
  const auto listed = names_in_use(backend, "jobs/", 10, kSoon);
  EXPECT_EQ(names_of(listed), (std::vector<std::string>{"jobs/a", "jobs/b"}));
  ASSERT_EQ(listed.names.size(), 2u);
  EXPECT_EQ(listed.names[0].holders, 1u);
  EXPECT_EQ(listed.names[0].waiters, 2u);
  EXPECT_EQ(listed.names[0].mode, "lock");
  EXPECT_FALSE(listed.truncated);
  backend.complete = false;  // the backend's scan stopped at its bound: more may be in use
  EXPECT_TRUE(names_in_use(backend, "jobs/", 10, kSoon).truncated);
}

// 450 candidates, three in use: inspected 200 at a time, and no further than the batch that
// fills max_names; truncated only when a name in use (or an unlooked-at candidate) is left.
TEST(NamesInUse, InspectsCandidatesAFewHundredAtATimeAndStopsOnceFull) {
  ListedBackend backend;
  for (int i = 0; i < 450; ++i) backend.candidates.push_back("n" + std::to_string(1000 + i));
  backend.in_use = {{"n1010", {1, 0}}, {"n1300", {1, 0}}, {"n1449", {1, 0}}};
  const auto all = names_in_use(backend, "", 100, kSoon);
  EXPECT_EQ(names_of(all), (std::vector<std::string>{"n1010", "n1300", "n1449"}));
  EXPECT_FALSE(all.truncated);
  EXPECT_EQ(backend.batches, (std::vector<std::size_t>{200, 200, 50}));

  backend.batches.clear();
  const auto three = names_in_use(backend, "", 3, kSoon);
  EXPECT_EQ(three.names.size(), 3u);
  EXPECT_FALSE(three.truncated) << "every candidate was looked at";

  backend.batches.clear();
  const auto two = names_in_use(backend, "", 2, kSoon);
  EXPECT_EQ(names_of(two), (std::vector<std::string>{"n1010", "n1300"}));
  EXPECT_TRUE(two.truncated);
  EXPECT_EQ(backend.batches, (std::vector<std::size_t>{200, 200}));

  backend.batches.clear();
  const auto one = names_in_use(backend, "", 1, kSoon);
  EXPECT_EQ(names_of(one), std::vector<std::string>{"n1010"});
  EXPECT_TRUE(one.truncated);
  EXPECT_EQ(backend.batches, std::vector<std::size_t>{200}) << "went on past the batch that filled it";
}

TEST(NamesInUse, RefusesAPrefixNoNameHasAndABadMaximum) {
  ListedBackend backend;
  for (const std::string& prefix : std::vector<std::string>{"/jobs", "a//b", "a\x01", std::string(256, 'x')}) {
    EXPECT_THROW(names_in_use(backend, prefix, 10, kSoon), turnstile::InvalidArgument) << prefix;
  }
  EXPECT_THROW(names_in_use(backend, "", 0, kSoon), turnstile::InvalidArgument);
  EXPECT_THROW(names_in_use(backend, "", 10'001, kSoon), turnstile::InvalidArgument);
  EXPECT_NO_THROW(names_in_use(backend, "jobs/ni", 10'000, kSoon));
}

}  // namespace
