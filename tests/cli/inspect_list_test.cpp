// SPDX-License-Identifier: Apache-2.0
// `turnstile inspect` without NAME (issue 24 item 9): the names in use with their holder and
// waiter counts, --prefix and --max-names; the table's columns for 16-digit tokens and labels;
// a timestamp on every JSON look. On the embedded backend (cli_server_test: the servers).
#include "cli_support.hpp"

namespace {

using namespace cli_tests;

class InspectListTest : public CliTest {
 protected:
  nlohmann::json list_json(std::vector<std::string> extra = {}) {
    std::vector<std::string> args{"inspect", "--backend", backend_, "--json"};
    args.insert(args.end(), extra.begin(), extra.end());
    const auto result = run(args);
    EXPECT_EQ(result.status, 0) << result.err;
    return nlohmann::json::parse(result.out, nullptr, false);
  }

  static std::vector<std::string> names_of(const nlohmann::json& list) {
    std::vector<std::string> names;
    for (const auto& n : list["names"]) names.push_back(n["name"].get<std::string>());
    return names;
  }

  // A `run` whose child holds until `release` exists, started once it runs.
  Process hold_semaphore(const std::string& name, const std::string& ready, const std::string& release) {
    auto process = start({"run", "--backend", backend_, "--semaphore", name, "--limit", "3", "--", "sh", "-c",
                          "touch " + ready + "; while [ ! -e " + release + " ]; do sleep 0.02; done"});
    EXPECT_TRUE(wait_until([&] { return fs::exists(ready); })) << process.err();
    return process;
  }
};

TEST_F(InspectListTest, ListsTheNamesInUseWithTheirCounts) {
  ASSERT_EQ(run(lock_sh("done/earlier", "true")).status, 0);      // used once: its state file stays, empty
  const std::string long_name = "deep/" + std::string(240, 'x');  // stored under a hashed file name
  const auto release = path("release");
  auto holder = hold_until("jobs/report", path("ready1"), release);
  auto waiter = start(lock_sh("jobs/report", "true"));
  ASSERT_TRUE(wait_until([&] { return waiter_count_is("jobs/report", 1); })) << waiter.err();
  auto pool = hold_semaphore("pool", path("ready2"), release);
  auto unicode = hold_until("caf\xc3\xa9/n\xc3\xa4me", path("ready3"), release);
  auto long_holder = hold_until(long_name, path("ready4"), release);

  const auto all = list_json();
  EXPECT_EQ(all["schema_version"], 1);
  EXPECT_EQ(all["backend"], backend_);
  EXPECT_FALSE(all["truncated"].get<bool>());
  EXPECT_TRUE(all["time"].get<std::string>().ends_with("Z")) << all.dump();
  EXPECT_EQ(names_of(all), (std::vector<std::string>{"caf\xc3\xa9/n\xc3\xa4me", long_name, "jobs/report", "pool"}))
      << all.dump();
  for (const auto& n : all["names"]) {
    if (n["name"] == "jobs/report") {
      EXPECT_EQ(n["mode"], "lock");
      EXPECT_TRUE(n["limit"].is_null());
      EXPECT_EQ(n["holders"], 1);
      EXPECT_EQ(n["waiters"], 1);
    } else if (n["name"] == "pool") {
      EXPECT_EQ(n["mode"], "semaphore");
      EXPECT_EQ(n["limit"], 3);
      EXPECT_EQ(n["holders"], 1);
      EXPECT_EQ(n["waiters"], 0);
    }
  }
  EXPECT_EQ(names_of(list_json({"--prefix", "jobs/"})), std::vector<std::string>{"jobs/report"});
  EXPECT_EQ(names_of(list_json({"--prefix", "po"})), std::vector<std::string>{"pool"});
  const auto first = list_json({"--max-names", "1"});
  EXPECT_EQ(names_of(first), std::vector<std::string>{"caf\xc3\xa9/n\xc3\xa4me"});
  EXPECT_TRUE(first["truncated"].get<bool>());

  const auto table = run({"inspect", "--backend", backend_});
  EXPECT_EQ(table.status, 0) << table.err;
  EXPECT_NE(table.out.find("NAME"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("HOLDERS"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("WAITERS"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("jobs/report"), std::string::npos) << table.out;
  EXPECT_EQ(table.out.find("done/earlier"), std::string::npos) << table.out;

  write_file(release, "");
  for (auto* p : {&holder, &waiter, &pool, &unicode, &long_holder}) EXPECT_EQ(wait_exit(*p), 0) << p->err();
  EXPECT_TRUE(list_json()["names"].empty());
  EXPECT_NE(run({"inspect", "--backend", backend_}).out.find("(no name in use)"), std::string::npos);
}

// A state file an older turnstile version left (refused by `inspect NAME` until it is removed)
// is passed over: the listing still shows the names in use, instead of failing on it (69).
TEST_F(InspectListTest, AStateFileOfAnOlderVersionDoesNotEndTheListing) {
  const auto release = path("release");
  auto holder = hold_until("job", path("ready"), release);
  // Written in this boot by version 1 (same size): a copy of a real state file, its version set
  // back to 1.
  fs::copy_file(backend_dir_ + "/n.job.s", backend_dir_ + "/n.old.s");
  {
    std::fstream old(backend_dir_ + "/n.old.s", std::ios::in | std::ios::out | std::ios::binary);
    const std::uint32_t version = 1;
    old.seekp(4);
    old.write(reinterpret_cast<const char*>(&version), sizeof version);
  }
  EXPECT_EQ(run({"inspect", "--backend", backend_, "old"}).status, 69);  // what made listings fail
  EXPECT_EQ(names_of(list_json()), std::vector<std::string>{"job"});
  write_file(release, "");
  EXPECT_EQ(wait_exit(holder), 0);
}

// A directory that does not exist lists nothing and is not created; listing options go without
// NAME, and bad ones are refused with 64.
TEST_F(InspectListTest, RefusesBadListingOptionsAndCreatesNothing) {
  const auto missing = dir_ + "/not/there";
  const auto empty = run({"inspect", "--json", "--backend", "file://" + missing});
  ASSERT_EQ(empty.status, 0) << empty.err;
  EXPECT_TRUE(nlohmann::json::parse(empty.out)["names"].empty()) << empty.out;
  EXPECT_FALSE(fs::exists(dir_ + "/not")) << "inspect created the directory";
  ASSERT_EQ(run(lock_sh("job", "true")).status, 0);
  for (const auto& args : std::vector<std::vector<std::string>>{{"--prefix", "jobs/", "job"},
                                                                {"--max-names", "5", "job"},
                                                                {"--max-names", "0"},
                                                                {"--max-names", "10001"},
                                                                {"--prefix", "/jobs"},
                                                                {"--prefix", "a//b"},
                                                                {"--prefix", "a\x01"}}) {
    std::vector<std::string> full{"inspect", "--backend", backend_};
    full.insert(full.end(), args.begin(), args.end());
    const auto refused = run(full);
    EXPECT_EQ(refused.status, 64) << args.front() << ": " << refused.err;
    EXPECT_FALSE(refused.err.empty());
  }
}

// The holder table keeps its columns with 16-digit tokens (the embedded backend's: microseconds
// since 1970) and gives the label a header of its own.
TEST_F(InspectListTest, TableColumnsFitLongTokensAndLabelsHaveAHeader) {
  Launch pipes;
  pipes.stdin_pipe = pipes.stdout_pipe = true;
  auto holder = start({"hold", "--backend", backend_, "--holder-label", "nightly report", "job"}, pipes);
  const auto token = read_line(holder.stdout_fd);
  ASSERT_GE(token.size(), 16u) << holder.err();
  const auto table = run({"inspect", "--backend", backend_, "job"});
  ASSERT_EQ(table.status, 0) << table.err;
  std::istringstream lines(table.out);
  std::string header, row;
  for (std::string line; std::getline(lines, line);) {
    if (line.starts_with("ROLE")) header = line;
    if (line.starts_with("holder")) row = line;
  }
  ASSERT_FALSE(header.empty() || row.empty()) << table.out;
  EXPECT_EQ(row.find(token), header.find("TOKEN")) << table.out;
  EXPECT_EQ(row.find("exclusive"), header.find("KIND")) << table.out;
  EXPECT_EQ(row.find("\"nightly report\""), header.find("LABEL")) << table.out;
  close_pipe(holder.stdin_fd);
  EXPECT_EQ(wait_exit(holder), 0) << holder.err();
}

// Every --watch --json line says when it was looked at (and a view is printed again only when
// the queue changed, not the time).
TEST_F(InspectListTest, WatchJsonLinesCarryATimestamp) {
  auto watcher = start({"inspect", "--backend", backend_, "--watch", "--json", "--interval", "0.05"});
  ASSERT_TRUE(wait_until([&] { return !watcher.out().empty(); })) << watcher.err();
  const auto release = path("release");
  auto holder = hold_until("job", path("ready"), release);
  ASSERT_TRUE(wait_until([&] { return watcher.out().find("\"job\"") != std::string::npos; })) << watcher.out();
  usleep(300'000);  // six more looks: none printed, nothing changed
  kill(watcher.pid, SIGTERM);
  EXPECT_EQ(wait_exit(watcher), 0) << watcher.err();
  std::istringstream lines(watcher.out());
  std::vector<nlohmann::json> looks;
  for (std::string line; std::getline(lines, line);) looks.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(looks.size(), 2u) << watcher.out();
  for (const auto& look : looks) EXPECT_TRUE(look["time"].get<std::string>().ends_with("Z")) << look.dump();
  EXPECT_LE(looks[0]["time"].get<std::string>(), looks[1]["time"].get<std::string>());
  write_file(release, "");
  EXPECT_EQ(wait_exit(holder), 0);
}

}  // namespace
