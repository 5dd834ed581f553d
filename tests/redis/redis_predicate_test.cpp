// SPDX-License-Identifier: Apache-2.0
// Issue 11: the Redis backend keeps its queue predicate on the server (the Lua admit() in
// queue_prelude.lua) for atomicity, so it is a second copy of evaluate_queue (src/core/queue.cpp).
// This property test runs many random queues through both, on a real redis-server, and demands
// the same verdict for every entry.
#include <hiredis/hiredis.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/queue.hpp"
#include "support/server_tests.hpp"
#include "turnstile/client.hpp"

namespace {

using namespace server_tests;
using turnstile::detail::EntryKind;
using turnstile::detail::QueueEntryView;

std::string read_script(const std::string& file) {
  std::ifstream in(std::string(TURNSTILE_REDIS_SCRIPTS_DIR) + "/" + file);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

struct Entry {
  EntryKind kind;
  std::int64_t permits;
  bool downgraded;  // a writer that became a reader in place: stored admitted already
};

struct Queue {
  std::int64_t limit = 0;  // 0 for locks, as the scripts store it
  std::vector<Entry> entries;
};

std::string describe(const Queue& queue) {
  std::string text = "limit " + std::to_string(queue.limit) + ":";
  for (const auto& e : queue.entries) {
    text += std::string(" ") + turnstile::detail::to_string(e.kind) + (e.downgraded ? "(downgraded)" : "") + "/" +
            std::to_string(e.permits);
  }
  return text;
}

// Locks (writers, readers, a downgraded writer at the front) or leases of one limit: a name's
// queue never mixes the two, and all its leases share one limit (acquire.lua refuses others).
Queue random_queue(std::mt19937_64& random) {
  const auto uniform = [&](std::int64_t low, std::int64_t high) {
    return std::uniform_int_distribution<std::int64_t>(low, high)(random);
  };
  Queue queue;
  const auto length = uniform(1, 12);
  if (uniform(0, 1) == 0) {
    for (std::int64_t i = 0; i < length; ++i) {
      queue.entries.push_back({uniform(0, 1) == 0 ? EntryKind::exclusive : EntryKind::shared, 1, false});
    }
    // A downgraded writer can only be first: it was admitted as a writer (so nothing was ahead)
    // and whatever queued since is behind it.
    if (uniform(0, 2) == 0) queue.entries[0] = {EntryKind::shared, 1, true};
    return queue;
  }
  queue.limit = uniform(0, 5) == 0 ? turnstile::max_permits : uniform(1, 10);
  for (std::int64_t i = 0; i < length; ++i) {
    std::int64_t permits;
    switch (uniform(0, 5)) {
      case 0: permits = turnstile::max_permits - uniform(0, 10); break;  // near the largest allowed
      case 1: permits = uniform(1, turnstile::max_permits); break;       // maybe above the limit
      case 2: permits = uniform(1, 3); break;                            // small, in a large limit
      default: permits = uniform(1, queue.limit); break;
    }
    queue.entries.push_back({EntryKind::lease, permits, false});
  }
  return queue;
}

class RedisPredicate : public ::testing::Test {
 public:
  void SetUp() override {
    const auto url = read_first_line(TURNSTILE_REDIS_URL_FILE);
    ASSERT_FALSE(url.empty()) << "no URL in " << TURNSTILE_REDIS_URL_FILE;
    const auto port = std::stoi(url.substr(url.rfind(':') + 1));
    context_.reset(redisConnect("127.0.0.1", port));
    ASSERT_TRUE(context_ && !context_->err) << (context_ ? context_->errstr : "no memory");
  }

  using Reply = std::unique_ptr<redisReply, decltype(&freeReplyObject)>;
  Reply command(const std::vector<std::string>& arguments) {
    std::vector<const char*> argv;
    std::vector<std::size_t> lengths;
    for (const auto& argument : arguments) {
      argv.push_back(argument.data());
      lengths.push_back(argument.size());
    }
    return Reply(static_cast<redisReply*>(
                     redisCommandArgv(context_.get(), static_cast<int>(argv.size()), argv.data(), lengths.data())),
                 freeReplyObject);
  }

  // {status, seq} of a join with `acquire` (the script's text) on `key` by request `request`
  // with a lease of `lease_ms` (marked with its client's watermark: see common_prelude.lua).
  std::pair<long long, std::string> join(const std::string& acquire, const std::string& key, const std::string& request,
                                         const std::string& lease_ms = "60000") {
    const auto channel = key.substr(0, key.size() - 1) + "w:0";
    auto reply =
        command({"EVAL", acquire, "1", key, channel, "x", "1", "0", lease_ms, "0", request + ":1", "1 test", ""});
    EXPECT_TRUE(reply && reply->type == REDIS_REPLY_ARRAY && reply->elements == 2)
        << (reply && reply->str ? reply->str : "");
    if (!reply || reply->type != REDIS_REPLY_ARRAY || reply->elements != 2) return {-1, ""};
    return {reply->element[0]->integer, std::to_string(reply->element[1]->integer)};
  }

  // Runs random queues through `decide` (Lua run after load(), marking e.admitted on `entries`)
  // and demands evaluate_queue's verdict for every entry.
  void agrees_with_core_on_random_queues(const std::string& decide);

  std::unique_ptr<redisContext, decltype(&redisFree)> context_{nullptr, redisFree};
};

// The commands scripts run on one name's keys, read from MONITOR (which shows the commands a
// script calls) on a connection of its own.
class ScriptMonitor {
 public:
  explicit ScriptMonitor(RedisPredicate& test) : test_(test) {
    const auto url = read_first_line(TURNSTILE_REDIS_URL_FILE);
    monitor_.reset(redisConnect("127.0.0.1", std::stoi(url.substr(url.rfind(':') + 1))));
    if (!monitor_ || monitor_->err) return;
    timeval patience{10, 0};  // a guard against a hang, not a measurement
    redisSetTimeout(monitor_.get(), patience);
    Reply ok(static_cast<redisReply*>(redisCommand(monitor_.get(), "MONITOR")), freeReplyObject);
    started_ = ok && ok->type == REDIS_REPLY_STATUS;
  }
  bool started() const { return started_; }

  // What scripts ran on `name`'s keys (queue and channel) since the last call: read from
  // MONITOR up to a marker sent now.
  std::vector<std::string> ran_since(const std::string& name) {
    std::vector<std::string> ran;
    const auto marker = "script-monitor-marker-" + name + "-" + std::to_string(++markers_);
    test_.command({"ECHO", marker});
    for (;;) {
      void* raw = nullptr;
      if (redisGetReply(monitor_.get(), &raw) != REDIS_OK || !raw) {
        ADD_FAILURE() << "MONITOR went quiet";
        break;
      }
      Reply line(static_cast<redisReply*>(raw), freeReplyObject);
      const std::string text = line->type == REDIS_REPLY_STATUS ? std::string(line->str, line->len) : "";
      if (text.find(marker) != std::string::npos) break;
      if (text.find(" lua] ") != std::string::npos && text.find("{" + name + "}") != std::string::npos)
        ran.push_back(text);
    }
    return ran;
  }
  static long count(const std::vector<std::string>& ran, const std::string& command) {
    return std::count_if(ran.begin(), ran.end(), [&](const std::string& line) {
      return line.find("\"" + command + "\"") != std::string::npos;
    });
  }

 private:
  using Reply = RedisPredicate::Reply;
  RedisPredicate& test_;
  std::unique_ptr<redisContext, decltype(&redisFree)> monitor_{nullptr, redisFree};
  bool started_ = false;
  int markers_ = 0;
};

// The set-up of the tests that count what a script runs: a queue of a name of its own, driven
// by the scripts themselves, with MONITOR showing the commands they run on it.
struct MonitoredQueue {
  MonitoredQueue(RedisPredicate& test, const std::string& label)
      : monitor(test), name(unique_name(label)), key("turnstile:{" + name + "}:q"),
        channel("turnstile:{" + name + "}:w:0") {}
  // A queue script as the backend runs it: its preludes first (src/backends/redis/CMakeLists.txt).
  static std::string script(const std::string& file) {
    return read_script("common_prelude.lua") + read_script("queue_prelude.lua") + read_script(file);
  }
  // What the scripts ran on the queue since the last call.
  std::vector<std::string> ran_since() { return monitor.ran_since(name); }

  ScriptMonitor monitor;
  const std::string name, key, channel;
};

// For every entry of a queue just loaded, admitted-or-not by admit() and by evaluate_queue.
//
// Why this comparison: admit() marks entries admitted and never unmarks them (a holder keeps its
// hold until it leaves), so on a queue that went through earlier runs its verdict depends on
// history, while evaluate_queue only sees the queue as it stands. On a FRESH queue (nobody
// marked yet, except a downgraded writer, which the downgrade keeps admitted) one admit() run
// decides every entry from the queue alone, and that is exactly what evaluate_queue says of
// each entry in order. The marks then stay right: evaluate_queue never withdraws an admission
// as entries ahead leave, others join behind, or writers downgrade, so an entry marked earlier is
// one it still admits, and each later admit() run walks the same fresh-queue walk again.
void RedisPredicate::agrees_with_core_on_random_queues(const std::string& decide) {
  // The real prelude text (as src/backends/redis/CMakeLists.txt prepends it to every queue
  // script), then: load the hash, decide, report who is admitted. No save(): the hash is left
  // as written.
  const auto harness = read_script("common_prelude.lua") + read_script("queue_prelude.lua") + "\nload()\n" + decide +
                       "\nlocal out = {}\n"
                       "for _, e in ipairs(entries) do out[#out + 1] = {e.seq, e.admitted and 1 or 0} end\n"
                       "return out\n";
  const auto loaded = command({"SCRIPT", "LOAD", harness});
  ASSERT_TRUE(loaded && loaded->type == REDIS_REPLY_STRING) << (loaded ? loaded->str : "no reply");
  const std::string sha(loaded->str, loaded->len);
  // A key of its own: the two tests through here may run at once on the suite's server.
  const std::string key = "turnstile:{" + unique_name("predicate") + "}:q";

  std::uint64_t seed = std::random_device{}();
  if (const char* fixed = std::getenv("TURNSTILE_PREDICATE_SEED")) seed = std::stoull(fixed);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with TURNSTILE_PREDICATE_SEED=" + std::to_string(seed) + ")");
  std::mt19937_64 random(seed);

  int leases = 0, locks = 0, downgrades = 0, waiting = 0;
  for (int round = 0; round < 2000; ++round) {
    const auto queue = random_queue(random);
    std::vector<std::string> hset{"HSET", key};
    std::vector<QueueEntryView> views;
    for (std::size_t i = 0; i < queue.entries.size(); ++i) {
      const auto& e = queue.entries[i];
      const char kind = e.kind == EntryKind::exclusive ? 'x' : e.kind == EntryKind::shared ? 's' : 'l';
      // "<kind><admitted> <permits> <limit> <request> <until ms> <pid> <host> <since ms>", far from expiry.
      hset.push_back(std::to_string(i + 1));
      hset.push_back(std::string(1, kind) + (e.downgraded ? "1 " : "0 ") + std::to_string(e.permits) + " " +
                     std::to_string(queue.limit) + " c" + std::to_string(i) + ":1 99999999999999 1 test 0");
      views.push_back({e.kind, e.permits});
    }
    ASSERT_TRUE(command({"DEL", key}));
    const auto written = command(hset);
    ASSERT_TRUE(written && written->type == REDIS_REPLY_INTEGER);
    const auto reply = command({"EVALSHA", sha, "1", key, "predicate-test-channel"});
    ASSERT_TRUE(reply && reply->type == REDIS_REPLY_ARRAY) << (reply && reply->str ? reply->str : "no reply");
    ASSERT_EQ(reply->elements, queue.entries.size()) << describe(queue);  // none dropped as unreadable

    for (std::size_t i = 0; i < queue.entries.size(); ++i) {
      const auto* row = reply->element[i];
      ASSERT_EQ(row->element[0]->integer, static_cast<long long>(i + 1)) << describe(queue);
      const bool lua = row->element[1]->integer == 1;
      const bool core = turnstile::detail::evaluate_queue(views, i, queue.limit).admitted();
      EXPECT_EQ(lua, core) << "entry " << i << " of " << describe(queue) << ": Lua admit() says "
                           << (lua ? "admitted" : "waiting") << ", evaluate_queue says "
                           << (core ? "admitted" : "waiting");
      if (lua != core) return;  // one queue's disagreement is enough to read
      waiting += !core;
    }
    (queue.limit ? leases : locks) += 1;
    downgrades += queue.entries[0].downgraded;
  }
  command({"DEL", key});
  // The random queues covered what they are meant to: both families, downgrades, and waiters.
  EXPECT_GT(leases, 300);
  EXPECT_GT(locks, 300);
  EXPECT_GT(downgrades, 100);
  EXPECT_GT(waiting, 1000);
}

TEST_F(RedisPredicate, LuaAdmitAgreesWithTheCorePredicateOnRandomQueues) {
  agrees_with_core_on_random_queues("admit(nil)");
}

// Issue 26: the index's admission (F.admit: from the first waiting entry on, told by the
// admitted prefix's totals) agrees too, on the index a walk writes for the queue (every queue
// indexed here, however short).
TEST_F(RedisPredicate, TheIndexsAdmissionAgreesWithTheCorePredicateOnRandomQueues) {
  agrees_with_core_on_random_queues(
      "index_from = 0\n"
      "local F = fast_path()\n"
      "F.rebuild()\n"
      "local head, tail, fw, ax, as, ap = string.match(fields['i'], '^(%d+) (%d+) (%d+) (%d+) (%d+) (%d+)$')\n"
      "local ix = {head = head, tail = tail, fw = fw, ax = tonumber(ax), as = tonumber(as), ap = tonumber(ap)}\n"
      "if not F.admit(ix, nil, {}) then return redis.error_reply('the index did not explain the queue') end\n"
      "for _, e in ipairs(entries) do e.admitted = string.sub(fields[e.field], 2, 2) == '1' end\n");
}

// Issue 14: 1000 waiters renew their entries every round, so a renewal must not read the whole
// queue: renew.lua reads and writes only the entries it names while the queue's 'w' field says
// none can have expired and no field came or went since the last walk. It still walks (and
// prunes, and admits) once an entry's lease may have ended, or the hash changed behind the
// scripts' back. What the scripts run is read from MONITOR (which shows the commands a script
// calls) on a connection of its own.
TEST_F(RedisPredicate, ARenewalReadsOnlyItsOwnEntriesUntilOneMayHaveExpired) {
  MonitoredQueue queue(*this, "renew-cost");
  ASSERT_TRUE(queue.monitor.started());
  const auto acquire = MonitoredQueue::script("acquire.lua");
  const auto renew = MonitoredQueue::script("renew.lua");
  const auto& key = queue.key;
  std::vector<std::string> seqs;
  for (int i = 0; i < 200; ++i) seqs.push_back(join(acquire, key, "c" + std::to_string(i) + ":1").second);
  // Renews entry `i` of `seqs`: its answer, and the commands that renewal ran.
  const auto renew_entry = [&](std::size_t i, std::vector<std::string>& ran) {
    queue.ran_since();  // what came before
    auto reply = command({"EVAL", renew, "1", key, queue.channel, "60000", seqs[i], "c" + std::to_string(i) + ":1"});
    EXPECT_TRUE(reply && reply->type == REDIS_REPLY_ARRAY && reply->elements == 1)
        << (reply && reply->str ? reply->str : "");
    ran = queue.ran_since();
    return reply && reply->type == REDIS_REPLY_ARRAY && reply->elements == 1 ? reply->element[0]->integer : -1;
  };
  const auto count = ScriptMonitor::count;

  // Nothing expired: the entry is read and written, nothing else.
  std::vector<std::string> ran;
  EXPECT_EQ(renew_entry(100, ran), 1);  // waiting
  EXPECT_EQ(count(ran, "HGETALL"), 0) << "a renewal read the whole queue";
  EXPECT_LE(ran.size(), 5u) << "a renewal of one entry of 200 ran more than a few commands on the queue";

  // An entry whose lease ends at once (its client died): the next renewal, of anyone's, walks
  // the queue and prunes it.
  const auto dying = join(acquire, key, "dead:1", "1").second;
  ASSERT_EQ(command({"HEXISTS", key, dying})->integer, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // past its lease (1 ms)
  ran.clear();
  EXPECT_EQ(renew_entry(100, ran), 1);
  EXPECT_EQ(count(ran, "HGETALL"), 1) << "a renewal after a lease ended did not walk the queue";
  EXPECT_EQ(command({"HEXISTS", key, dying})->integer, 0) << "the expired entry was not pruned";

  // The holder's entry deleted by hand (no script ran): the next renewal walks and admits the next.
  ASSERT_EQ(command({"HDEL", key, seqs[0]})->integer, 1);
  ran.clear();
  EXPECT_EQ(renew_entry(1, ran), 2) << "the entry behind a vanished holder was not admitted";
  EXPECT_EQ(count(ran, "HGETALL"), 1);
  EXPECT_EQ(count(ran, "PUBLISH"), 1) << "the admitted entry's waiter was not named";
  command({"DEL", key});
}

// Issue 25: an uncontended acquire and release do the least: the acquire reads the hash and
// writes it once (its 'w' field counted from what it read, not asked with HLEN and written
// again), the release reads it, deletes the entry and writes its request record. The quick
// renewal above checks that such a 'w' counts the hash exactly.
TEST_F(RedisPredicate, AnUncontendedAcquireAndReleaseWriteTheHashOnce) {
  MonitoredQueue queue(*this, "uncontended-cost");
  ASSERT_TRUE(queue.monitor.started());
  const auto& key = queue.key;
  queue.ran_since();
  const auto joined = command({"EVAL", MonitoredQueue::script("acquire.lua"), "1", key, queue.channel, "x", "1", "0",
                               "60000", "0", "c1:1:1", "1 test", ""});
  ASSERT_TRUE(joined && joined->type == REDIS_REPLY_ARRAY && joined->elements == 2);
  ASSERT_EQ(joined->element[0]->integer, 1);
  const auto acquired = queue.ran_since();
  // (On the name's key: TIME comes first, as in every script; then HEXISTS asks whether the
  // queue has an index, which a short queue has not: see queue_prelude.lua.)
  EXPECT_EQ(acquired.size(), 3u) << "HEXISTS, HGETALL, one HSET; ran " << acquired.size();
  EXPECT_EQ(ScriptMonitor::count(acquired, "HLEN"), 0);
  const auto w = command({"HGET", key, "w"});
  ASSERT_TRUE(w && w->type == REDIS_REPLY_STRING);
  EXPECT_EQ(std::string(w->str, w->len).substr(std::string(w->str, w->len).find(' ') + 1),
            std::to_string(command({"HLEN", key})->integer))
      << "'w' counts the hash's fields";

  const auto seq = std::to_string(joined->element[1]->integer);
  const auto released = command(
      {"EVAL", MonitoredQueue::script("release.lua"), "1", key, queue.channel, seq, "c1:1", "120000", "c1:2:2"});
  ASSERT_TRUE(released && released->type == REDIS_REPLY_INTEGER) << (released && released->str ? released->str : "");
  EXPECT_EQ(released->integer, 1);
  const auto release_ran = queue.ran_since();
  EXPECT_EQ(release_ran.size(), 4u) << "HEXISTS, HGETALL, HDEL, HSET; ran " << release_ran.size();
  command({"DEL", key});
}

// Issue 26: a queue written last by an older build has no index (its scripts drop the fields
// they do not know: 'i' and the 'p<seq>' links, all at once, and count 'w' without them). The
// next script walks it and writes the index again; the join after that goes through the index
// and reads no whole hash; admission stays in order.
TEST_F(RedisPredicate, AQueueAnOlderBuildLeftWithoutItsIndexIsWalkedOnceAndIndexedAgain) {
  MonitoredQueue queue(*this, "old-build");
  ASSERT_TRUE(queue.monitor.started());
  const auto acquire = MonitoredQueue::script("acquire.lua");
  const auto& key = queue.key;
  // A join by client c<i>'s first request.
  const auto join_as = [&](int i) { return join(acquire, key, "c" + std::to_string(i) + ":1"); };
  std::vector<std::string> seqs;
  for (int i = 0; i < 20; ++i) seqs.push_back(join_as(i).second);
  ASSERT_EQ(command({"HEXISTS", key, "i"})->integer, 1) << "20 entries and no index";

  // What an older build's script leaves: no index fields, 'w' counting what is left.
  std::vector<std::string> index_fields{"HDEL", key, "i"};
  for (const auto& seq : seqs) index_fields.push_back("p" + seq);
  ASSERT_EQ(command(index_fields)->integer, 21);
  const auto w = command({"HGET", key, "w"});
  const std::string walk_at(w->str, std::string(w->str, w->len).find(' '));
  command({"HSET", key, "w", walk_at + " " + std::to_string(command({"HLEN", key})->integer)});

  queue.ran_since();
  EXPECT_EQ(join_as(20).first, 2);
  EXPECT_EQ(ScriptMonitor::count(queue.ran_since(), "HGETALL"), 1) << "a queue without its index not walked";
  EXPECT_EQ(command({"HEXISTS", key, "i"})->integer, 1) << "the walk did not write the index again";
  EXPECT_EQ(join_as(21).first, 2);
  EXPECT_EQ(ScriptMonitor::count(queue.ran_since(), "HGETALL"), 0) << "the index written again was not used";

  // The holder leaves: the next in line, and only it, is admitted (through the index).
  const auto released = command(
      {"EVAL", MonitoredQueue::script("release.lua"), "1", key, queue.channel, seqs[0], "c0:1", "120000", "c0:2:2"});
  ASSERT_TRUE(released && released->type == REDIS_REPLY_INTEGER) << (released && released->str ? released->str : "");
  const auto ran = queue.ran_since();
  EXPECT_EQ(ScriptMonitor::count(ran, "HGETALL"), 0);
  EXPECT_EQ(ScriptMonitor::count(ran, "PUBLISH"), 1);
  const auto next = command({"HGET", key, seqs[1]});
  const auto after_next = command({"HGET", key, seqs[2]});
  EXPECT_EQ(std::string(next->str, 2), "x1") << "the next in line was not admitted";
  EXPECT_EQ(std::string(after_next->str, 2), "x0") << "two admitted by one release";
  command({"DEL", key});
}

}  // namespace
