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
#include <thread>

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
 protected:
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

  std::unique_ptr<redisContext, decltype(&redisFree)> context_{nullptr, redisFree};
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
TEST_F(RedisPredicate, LuaAdmitAgreesWithTheCorePredicateOnRandomQueues) {
  // The real prelude text (as src/backends/redis/CMakeLists.txt prepends it to every queue
  // script), then: load the hash, run admit() once, report who is admitted. No save(): the
  // hash is left as written.
  const auto harness = read_script("common_prelude.lua") + read_script("queue_prelude.lua") +
                       "\nload()\nadmit(nil)\nlocal out = {}\n"
                       "for _, e in ipairs(entries) do out[#out + 1] = {e.seq, e.admitted and 1 or 0} end\n"
                       "return out\n";
  const auto loaded = command({"SCRIPT", "LOAD", harness});
  ASSERT_TRUE(loaded && loaded->type == REDIS_REPLY_STRING) << (loaded ? loaded->str : "no reply");
  const std::string sha(loaded->str, loaded->len);
  const std::string key = "turnstile:{predicate-test}:q";

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

// Issue 14: 1000 waiters renew their entries every round, so a renewal must not read the whole
// queue: renew.lua reads and writes only the entries it names while the queue's 'w' field says
// none can have expired and no field came or went since the last walk. It still walks (and
// prunes, and admits) once an entry's lease may have ended, or the hash changed behind the
// scripts' back. What the scripts run is read from MONITOR (which shows the commands a script
// calls) on a connection of its own.
TEST_F(RedisPredicate, ARenewalReadsOnlyItsOwnEntriesUntilOneMayHaveExpired) {
  const auto url = read_first_line(TURNSTILE_REDIS_URL_FILE);
  const auto port = std::stoi(url.substr(url.rfind(':') + 1));
  std::unique_ptr<redisContext, decltype(&redisFree)> monitor(redisConnect("127.0.0.1", port), redisFree);
  ASSERT_TRUE(monitor && !monitor->err);
  timeval patience{10, 0};  // a guard against a hang, not a measurement
  redisSetTimeout(monitor.get(), patience);
  {
    Reply ok(static_cast<redisReply*>(redisCommand(monitor.get(), "MONITOR")), freeReplyObject);
    ASSERT_TRUE(ok && ok->type == REDIS_REPLY_STATUS);
  }
  const auto prelude = read_script("common_prelude.lua") + read_script("queue_prelude.lua");
  const auto acquire = prelude + read_script("acquire.lua");
  const auto renew = prelude + read_script("renew.lua");
  const auto name = unique_name("renew-cost");
  const std::string key = "turnstile:{" + name + "}:q", channel = "turnstile:{" + name + "}:w:0";
  // {status, seq} of a join by request `request` with a lease of `lease_ms` (marked with its
  // client's watermark: see common_prelude.lua).
  const auto join = [&](const std::string& request, const std::string& lease_ms) {
    auto reply =
        command({"EVAL", acquire, "1", key, channel, "x", "1", "0", lease_ms, "0", request + ":1", "1 test", ""});
    EXPECT_TRUE(reply && reply->type == REDIS_REPLY_ARRAY && reply->elements == 2)
        << (reply && reply->str ? reply->str : "");
    return std::to_string(reply->element[1]->integer);
  };
  std::vector<std::string> seqs;
  for (int i = 0; i < 200; ++i) seqs.push_back(join("c" + std::to_string(i) + ":1", "60000"));
  // The commands scripts ran on the name's keys (queue and channel) since the last call: read
  // from MONITOR up to a marker sent now.
  int markers = 0;
  const auto ran_since = [&] {
    std::vector<std::string> ran;
    const auto marker = "renew-cost-marker-" + name + "-" + std::to_string(++markers);
    command({"ECHO", marker});
    for (;;) {
      void* raw = nullptr;
      if (redisGetReply(monitor.get(), &raw) != REDIS_OK || !raw) {
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
  };
  // Renews entry `i` of `seqs`: its answer, and the commands that renewal ran.
  const auto renew_entry = [&](std::size_t i, std::vector<std::string>& ran) {
    ran_since();  // what came before
    auto reply = command({"EVAL", renew, "1", key, channel, "60000", seqs[i], "c" + std::to_string(i) + ":1"});
    EXPECT_TRUE(reply && reply->type == REDIS_REPLY_ARRAY && reply->elements == 1)
        << (reply && reply->str ? reply->str : "");
    ran = ran_since();
    return reply && reply->type == REDIS_REPLY_ARRAY && reply->elements == 1 ? reply->element[0]->integer : -1;
  };
  const auto count = [](const std::vector<std::string>& ran, const std::string& command) {
    return std::count_if(ran.begin(), ran.end(), [&](const std::string& line) {
      return line.find("\"" + command + "\"") != std::string::npos;
    });
  };

  // Nothing expired: the entry is read and written, nothing else.
  std::vector<std::string> ran;
  EXPECT_EQ(renew_entry(100, ran), 1);  // waiting
  EXPECT_EQ(count(ran, "HGETALL"), 0) << "a renewal read the whole queue";
  EXPECT_LE(ran.size(), 5u) << "a renewal of one entry of 200 ran more than a few commands on the queue";

  // An entry whose lease ends at once (its client died): the next renewal, of anyone's, walks
  // the queue and prunes it.
  const auto dying = join("dead:1", "1");
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

}  // namespace
