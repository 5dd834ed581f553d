// SPDX-License-Identifier: Apache-2.0
// What only the Redis backend promises: a server that restarts without its data makes holds
// lost, a lost wake-up message strands nobody, bad
// credentials fail at connect time, PermitCounter shares Redisson's layout, every key of a name
// shares one hash tag, and an uncontended lock+unlock costs two server commands.
//
// Tests that restart or count the server start their own redis-server (tests/servers/redis.sh);
// the others use the suite's fixture server, whose URL file is TURNSTILE_REDIS_URL_FILE.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <optional>
#include <random>
#include <vector>

#include "conformance/support.hpp"
#include "support/server_tests.hpp"

namespace {

using namespace std::chrono_literals;
using turnstile::Client;
using namespace server_tests;

class Redis : public ::testing::Test {
 protected:
  void SetUp() override {
    url_ = read_first_line(TURNSTILE_REDIS_URL_FILE);
    ASSERT_FALSE(url_.empty()) << "no URL in " << TURNSTILE_REDIS_URL_FILE << " (did the redis_server fixture run?)";
  }
  std::string url_;
};

TEST_F(Redis, ServerRestartWithoutDataReportsHoldsLost) {
  OwnServer server(TURNSTILE_REDIS_SCRIPT);
  auto client = Client::connect(server.url(), with_ttl(1500ms));
  auto mutex = client.mutex(unique_name("restart"));
  auto semaphore = client.semaphore(unique_name("restart-sem"), 2);
  mutex.lock();
  auto lease = semaphore.acquire();
  const auto lock_lost = mutex.lost_token();
  const auto lease_lost = lease.lost_token();
  ASSERT_EQ(server.restart(), 0);
  EXPECT_TRUE(eventually([&] { return lock_lost.stop_requested() && lease_lost.stop_requested(); }, 15s))
      << "holds survived a restart that forgot them";
  // Another client now gets the lock; the old holder's explicit release reports the loss.
  auto other = Client::connect(server.url());
  auto other_mutex = other.mutex(mutex.name());
  EXPECT_TRUE(other_mutex.try_lock_for(10s));
  EXPECT_THROW(mutex.release(), turnstile::HoldLost);
  EXPECT_THROW(lease.release(), turnstile::HoldLost);
  other_mutex.unlock();
}

TEST_F(Redis, RenewalsBlockedForLessThanTheTtlSuspendThenResumeTheHolds) {
  OwnServer server(TURNSTILE_REDIS_SCRIPT);
  // TTL 15 s: renewed every 5 s, each renewal given up after 1 s and tried again 250 ms
  // later; lost after 13.5 s without a renewal. The server answers nobody (SIGSTOP) until the
  // holds were seen suspended, at most some 6 s after the last renewal, and a retry gets through
  // soon after it answers again. (A timed CLIENT PAUSE could leave them suspended for as little
  // as a second, which a loaded machine may miss.)
  expect_outage_suspends_then_resumes(
      server.url(), 15s, [&] { ASSERT_EQ(server.action("pause"), 0); }, [&] { ASSERT_EQ(server.action("resume"), 0); });
}

// The state letter of a process in /proc/PID/stat ('T' when stopped), '?' when it is gone.
char process_state(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(in, line);
  const auto end = line.rfind(')');
  return end == std::string::npos || end + 2 >= line.size() ? '?' : line[end + 2];
}

// `turnstile run --pause-when-suspended` stops the command while its hold is suspended,
// continues it once the hold is confirmed again, and says both on stderr.
TEST_F(Redis, CliPausesTheCommandWhileItsHoldIsSuspended) {
  OwnServer server(TURNSTILE_REDIS_SCRIPT);
  const auto dir = std::filesystem::temp_directory_path() / ("turnstile-cli-suspend-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const auto pid_file = (dir / "pid").string(), release = (dir / "release").string(), err = (dir / "err").string();
  const std::string url = server.url();
  auto cli = conformance::Child::spawn([&]() -> int {
    std::freopen(err.c_str(), "w", stderr);
    const std::string script = "echo $$ > " + pid_file + "; while [ ! -e " + release + " ]; do sleep 0.05; done";
    execl(TURNSTILE_CLI_PATH, TURNSTILE_CLI_PATH, "run", "--backend", url.c_str(), "--ttl", "15",
          "--pause-when-suspended", "--lock", unique_name("cli").c_str(), "--", "sh", "-c", script.c_str(),
          static_cast<char*>(nullptr));
    return 127;
  });
  ASSERT_TRUE(eventually([&] { return !read_first_line(pid_file).empty(); }, 20s));
  const pid_t command = std::stoi(read_first_line(pid_file));
  EXPECT_NE(process_state(command), 'T');
  // TTL 15 s: renewed every 5 s, each renewal given up after 1 s; lost after 13.5 s without a
  // renewal. The server answers nobody from here until the command has been seen stopped (at
  // most some 6 s after the last renewal), so the suspension lasts as long as the test needs to
  // see it however loaded the machine is (a timed CLIENT PAUSE left it as little as a second).
  ASSERT_EQ(server.action("pause"), 0);
  const bool stopped = eventually([&] { return process_state(command) == 'T'; }, 12s);
  ASSERT_EQ(server.action("resume"), 0);
  EXPECT_TRUE(stopped) << "the command was not stopped";
  EXPECT_TRUE(eventually([&] { return process_state(command) != 'T'; }, 20s)) << "the command was not continued";
  std::ofstream(release).put('\n');
  EXPECT_EQ(cli.wait(20s), 0);
  const auto said = shell("cat " + quoted(err));
  EXPECT_NE(said.find("is suspended"), std::string::npos) << said;
  EXPECT_NE(said.find("confirmed again"), std::string::npos) << said;
  std::filesystem::remove_all(dir);
}

TEST_F(Redis, LostWakeUpMessageDoesNotStrandAWaiter) {
  const auto name = unique_name("lost-message");
  auto holder_client = Client::connect(url_);
  auto holder = holder_client.mutex(name);
  holder.lock();
  const auto holder_lost = holder.lost_token();
  auto waiter_client = Client::connect(url_);
  auto waiter = waiter_client.mutex(name);
  auto got = std::async(std::launch::async, [&] {
    const bool ok = waiter.try_lock_for(20s);
    if (ok) waiter.unlock();
    return ok;
  });
  ASSERT_TRUE(eventually([&] { return holder_client.inspect(name).waiters.size() == 1; }));
  // Remove the holder's entry behind turnstile's back: no release script runs, no message is
  // published. Only the waiter's periodic re-check can find out.
  const auto token = std::to_string(holder.fencing_token());
  redis_cli(url_, "HDEL " + quoted("turnstile:{" + name + "}:q") + " " + token);
  ASSERT_EQ(got.wait_for(15s), std::future_status::ready) << "the waiter was stranded by a lost message";
  EXPECT_TRUE(got.get());
  // And the holder whose entry vanished is told.
  EXPECT_TRUE(eventually([&] { return holder_lost.stop_requested(); }, 15s));
  holder.unlock();  // reports HoldLost to the error handler, never throws
}

// Issue 25: the release's script admits the next waiter and publishes its seq; the waiter
// named by that message checks its admission in the server's state with one HGET on its
// command connection, not another script call. What that connection sends after the release
// is read from MONITOR (redis-cli's, in its own process).
TEST_F(Redis, AWaiterNamedByTheReleaseChecksItsAdmissionWithoutAScript) {
  const auto name = unique_name("handoff");
  const auto channel = "\"turnstile:{" + name + "}:w:0\"";
  auto holder_client = Client::connect(url_);
  auto holder = holder_client.mutex(name);
  holder.lock();
  const auto holder_seq = std::to_string(holder.fencing_token());
  std::unique_ptr<FILE, decltype(&pclose)> monitor(
      popen(("stdbuf -oL redis-cli -u " + server_tests::quoted(url_) + " monitor | sed -u '/handoff-monitor-end/q'")
                .c_str(),
            "r"),
      pclose);
  ASSERT_TRUE(monitor);
  std::string first_line(256, '\0');
  ASSERT_TRUE(fgets(first_line.data(), static_cast<int>(first_line.size()), monitor.get())) << "no MONITOR";  // OK
  auto waiter_client = Client::connect(url_);
  auto waiter = waiter_client.mutex(name);
  // The waiter keeps its hold until MONITOR has been read: its release is no look.
  std::promise<void> read;
  auto got = std::async(std::launch::async, [&, done = read.get_future()] {
    const bool ok = waiter.try_lock_for(20s);
    done.wait();
    if (ok) waiter.unlock();
    return ok;
  });
  struct LetGo {  // on every way out, before `got` waits for the thread
    std::promise<void>& read;
    bool done = false;
    void now() {
      if (!std::exchange(done, true)) read.set_value();
    }
    ~LetGo() { now(); }
  } let_go{read};
  ASSERT_TRUE(eventually([&] { return holder_client.inspect(name).waiters.size() == 1; }));
  std::this_thread::sleep_for(1s);  // its look after subscribing, if any, is done by now
  holder.unlock();
  EXPECT_TRUE(eventually(
      [&] {
        const auto queue = holder_client.inspect(name);
        return queue.waiters.empty() && queue.holders.size() == 1;
      },
      15s))
      << "the waiter was not admitted";
  const auto marker = "handoff-marker-" + name;
  redis_cli(url_, "ECHO " + marker);
  // The waiter's command connection: the one that sent its acquire (the queue's first "x" join
  // seen here: the holder joined before MONITOR began). Then, after the holder's release (the
  // channel followed by the holder's seq), what that connection sent.
  std::string waiter_port, line(64 * 1024, '\0');
  const auto release = channel + " \"" + holder_seq + "\"";
  bool released = false;
  int scripts_after = 0, hgets_after = 0;
  while (fgets(line.data(), static_cast<int>(line.size()), monitor.get())) {
    const std::string text(line.c_str());
    if (text.find(marker) != std::string::npos) break;
    const auto open = text.find(" 127.0.0.1:"), close = text.find(']');
    if (open == std::string::npos || close == std::string::npos) continue;  // inside a script: "[0 lua]"
    const auto port = text.substr(open, close - open);
    if (waiter_port.empty() && text.find(channel + " \"x\"") != std::string::npos) waiter_port = port;
    if (text.find(release) != std::string::npos) released = true;
    if (!released || port != waiter_port) continue;
    scripts_after += text.find("\"EVALSHA\"") != std::string::npos || text.find("\"EVAL\"") != std::string::npos;
    hgets_after += text.find("\"HGET\"") != std::string::npos;
  }
  // sed ends at the end marker, and redis-cli at its next line (so pclose returns).
  redis_cli(url_, "ECHO handoff-monitor-end");
  redis_cli(url_, "ECHO handoff-monitor-end");
  let_go.now();
  EXPECT_TRUE(got.get());
  ASSERT_FALSE(waiter_port.empty()) << "the waiter's acquire was not seen";
  ASSERT_TRUE(released) << "the holder's release was not seen";
  EXPECT_EQ(scripts_after, 0) << "the waiter ran a script to learn it was admitted";
  EXPECT_EQ(hgets_after, 1);
}

TEST_F(Redis, BadCredentialsAndWrongServersFailAtConnect) {
  const auto hostport = url_.substr(std::string("redis://").size());
  const auto user = "t" + std::to_string(getpid());
  ASSERT_EQ(redis_cli(url_, "ACL SETUSER " + user + " on '>secret' '~*' '&*' '+@all'"), "OK");
  ASSERT_EQ(redis_cli(url_, "ACL SETUSER " + user + "-noscript on '>secret' '~*' '&*' '+@all' '-@scripting'"), "OK");
  EXPECT_NO_THROW(Client::connect("redis://" + user + ":secret@" + hostport));
  EXPECT_THROW(Client::connect("redis://" + user + ":wrong@" + hostport), turnstile::AccessDenied);
  EXPECT_THROW(Client::connect("redis://" + user + "-noscript:secret@" + hostport), turnstile::AccessDenied);
  redis_cli(url_, "ACL DELUSER " + user + " " + user + "-noscript");

  // Something that is not Redis: a TCP server answering like a web server.
  const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  ASSERT_EQ(listen(listener, 4), 0);
  socklen_t length = sizeof address;
  getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length);
  const auto port = ntohs(address.sin_port);
  std::thread web([listener] {
    const int connection = accept(listener, nullptr, nullptr);
    if (connection < 0) return;
    const char answer[] = "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n";
    [[maybe_unused]] auto written = write(connection, answer, sizeof answer - 1);
    close(connection);
  });
  try {
    Client::connect("redis://127.0.0.1:" + std::to_string(port));
    ADD_FAILURE() << "connected to a web server as if it were Redis";
  } catch (const turnstile::BackendUnavailable& error) {
    EXPECT_NE(std::string(error.what()).find("127.0.0.1:" + std::to_string(port)), std::string::npos) << error.what();
  }
  web.join();
  close(listener);
  // Nobody listening at all (the port was just released).
  EXPECT_THROW(Client::connect("redis://127.0.0.1:" + std::to_string(port)), turnstile::BackendUnavailable);
}

// A server with requirepass (the default user needs a password): Redis 7 closes a connection
// that sends a bulk over 16 KiB before it authenticated, and the connect sent its scripts right
// behind AUTH, so a wrong or missing password came out as "connection reset" (exit 69, not 77).
TEST(RedisPassword, AWrongOrMissingPasswordIsRefusedAsSuchAndTheRightOneWorks) {
  OwnServer server(TURNSTILE_REDIS_SCRIPT);
  const auto hostport = server.url().substr(std::string("redis://").size());
  ASSERT_EQ(redis_cli(server.url(), "CONFIG SET requirepass s3cret"), "OK");
  EXPECT_NO_THROW(Client::connect("redis://:s3cret@" + hostport).mutex("p").try_lock());
  for (const auto& url : {"redis://:wrong@" + hostport, "redis://" + hostport}) {
    try {
      Client::connect(url);
      ADD_FAILURE() << "connected to " << url;
    } catch (const turnstile::AccessDenied& error) {
      EXPECT_EQ(std::string(error.what()).find("s3cret"), std::string::npos) << error.what();
    } catch (const turnstile::Error& error) {
      ADD_FAILURE() << url << ": " << error.what();
    }
  }
}

TEST_F(Redis, UrlsAreCheckedBeforeConnecting) {
  EXPECT_THROW(Client::connect("redis://127.0.0.1:notaport"), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect("redis://127.0.0.1:1,127.0.0.1:2"), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect("redis://127.0.0.1:6379/x"), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect("redis://127.0.0.1:6379?ttl=abc"), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect("redis://127.0.0.1:6379?ttl=0"), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect("redis://127.0.0.1:6379?colour=red"), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect("rediss://127.0.0.1:6379"), turnstile::BackendNotBuilt);
  EXPECT_NO_THROW(Client::connect(url_ + "/3?ttl=2.5"));
}

TEST_F(Redis, PermitCounterSharesRedissonsLayout) {
  // A name with a space, braces and non-ASCII bytes: the key is the name itself, as Redisson's.
  const auto name = unique_name("budget {x} \xC3\xBC");
  auto client = Client::connect(url_);
  auto counter = client.permit_counter(name);
  EXPECT_TRUE(counter.try_set_permits(7));
  EXPECT_EQ(redis_cli(url_, "GET " + quoted(name)), "7");
  // What a Java RSemaphore does is seen here, and the other way round.
  redis_cli(url_, "SET " + quoted(name) + " 3");
  EXPECT_EQ(counter.available_permits(), 3);
  counter.acquire(2);
  EXPECT_EQ(redis_cli(url_, "GET " + quoted(name)), "1");
  // A waiter for 4 permits wakes when a Redisson client releases (INCRBY, then a message on
  // redisson_sc:NAME: Redisson adds no braces to a name that has a '{').
  auto waiter = std::async(std::launch::async, [&] {
    auto own = Client::connect(url_);
    return own.permit_counter(name).try_acquire_for(15s, 4);
  });
  ASSERT_TRUE(eventually([&] { return client.inspect(name).waiters.size() == 1; }));
  redis_cli(url_, "INCRBY " + quoted(name) + " 3");
  redis_cli(url_, "PUBLISH " + quoted("redisson_sc:" + name) + " 4");
  ASSERT_EQ(waiter.wait_for(15s), std::future_status::ready);
  EXPECT_TRUE(waiter.get());
  EXPECT_EQ(redis_cli(url_, "GET " + quoted(name)), "0");
  EXPECT_EQ(counter.drain_permits(), 0);
  redis_cli(url_, "DEL " + quoted(name));
}

TEST_F(Redis, EveryKeyOfANameSharesOneHashTag) {
  for (const std::string leaf : {"plain", "with space", "{braces}", "caf\xC3\xA9", "%25"}) {
    const auto name = unique_name(leaf);
    auto client = Client::connect(url_);
    auto mutex = client.mutex(name);
    auto reader = client.shared_mutex(name + "-rw");
    mutex.lock();
    reader.lock_shared();
    const auto inspection = client.inspect(name);
    ASSERT_EQ(inspection.holders.size(), 1u) << leaf;
    EXPECT_EQ(inspection.holders.front().fencing_token, mutex.fencing_token());
    // The name's one key carries the {tag}, and nothing else does.
    std::string encoded;
    for (char c : name)
      encoded += c == '{'   ? std::string("%7B")
                 : c == '}' ? std::string("%7D")
                 : c == '%' ? std::string("%25")
                            : std::string(1, c);
    const auto keys = redis_cli(url_, "--scan --pattern " + quoted("turnstile:{" + encoded + "}:*"));
    EXPECT_NE(keys.find("turnstile:{" + encoded + "}:q"), std::string::npos) << keys;
    reader.unlock_shared();
    mutex.unlock();
    EXPECT_TRUE(client.inspect(name).holders.empty());
  }
}

// The issue's budget: an uncontended lock+unlock is two scripts, i.e. two client commands.
TEST(RedisOwnServer, UncontendedLockUnlockCostsTwoCommands) {
  OwnServer server(TURNSTILE_REDIS_SCRIPT);
  auto client = Client::connect(server.url());
  auto mutex = client.mutex(unique_name("count"));
  mutex.lock();  // the first call may load scripts
  mutex.unlock();
  const auto calls = [&] {
    const auto stats = redis_cli(server.url(), "INFO commandstats");
    long long total = 0;
    for (const char* command : {"cmdstat_evalsha:calls=", "cmdstat_eval:calls="}) {
      if (const auto at = stats.find(command); at != std::string::npos)
        total += std::stoll(stats.substr(at + std::strlen(command)));
    }
    return total;
  };
  const auto before = calls();
  for (int i = 0; i < 10; ++i) {
    mutex.lock();
    mutex.unlock();
  }
  EXPECT_EQ(calls() - before, 20);
}

// The server's count of one command, scripts' calls included (INFO commandstats).
long long command_calls(const std::string& url, const std::string& command) {
  const auto stats = redis_cli(url, "INFO commandstats");
  const std::string counter = "cmdstat_" + command + ":calls=";
  const auto at = stats.find(counter);
  return at == std::string::npos ? 0 : std::stoll(stats.substr(at + counter.size()));
}

// Issue 26: joining behind many waiters, leaving from the middle, a refused try-once and a
// release that admits the next are each O(1) in the queue's length: none reads the name's whole
// hash (HGETALL: every script walked the queue before the index in queue_prelude.lua).
TEST(RedisOwnServer, JoinLeaveAndReleaseBehindManyWaitersReadNoWholeQueue) {
  OwnServer server(TURNSTILE_REDIS_SCRIPT);
  auto client = Client::connect(server.url());
  const auto name = unique_name("index");
  auto holder_client = Client::connect(server.url());  // get() refuses on a thread holding the name
  auto holder = holder_client.mutex(name);
  holder.lock();
  constexpr std::size_t kWaiters = 200;
  std::vector<turnstile::Mutex> mutexes;
  std::vector<turnstile::Acquiring<std::optional<turnstile::Lease>>> waiters;
  mutexes.reserve(kWaiters + 1);
  for (std::size_t i = 0; i < kWaiters; ++i) {
    mutexes.push_back(client.mutex(name));
    waiters.push_back(mutexes.back().lock_async());
    if (i == 0) {
      ASSERT_TRUE(eventually([&] { return client.inspect(name).waiters.size() == 1; }, 10s));
    }
  }
  ASSERT_TRUE(eventually([&] { return client.inspect(name).waiters.size() == kWaiters; }, 60s));
  const auto key = quoted("turnstile:{" + name + "}:q");
  const auto fields = [&] { return std::stoll(redis_cli(server.url(), "HLEN " + key)); };
  const auto walks_before = command_calls(server.url(), "hgetall");

  auto other = client.mutex(name);
  EXPECT_FALSE(other.try_lock());  // a refused try-once
  const auto fields_before = fields();
  waiters.push_back(other.lock_async());  // a join at the back
  ASSERT_TRUE(eventually([&] { return fields() > fields_before; }, 10s)) << "the last waiter never joined";
  const auto fields_queued = fields();
  waiters[kWaiters / 2].cancel();  // a leave from the middle
  EXPECT_FALSE(waiters[kWaiters / 2].get().has_value());
  ASSERT_TRUE(eventually([&] { return fields() < fields_queued; }, 10s)) << "the cancelled waiter never left";
  EXPECT_FALSE(waiters[0].ready()) << "admitted while the name was held";
  holder.unlock();  // a release admitting the first waiter
  ASSERT_TRUE(waiters[0].wait_for(10s));
  auto lease = waiters[0].get();
  ASSERT_TRUE(lease.has_value());
  EXPECT_FALSE(waiters[1].ready()) << "two admitted by one release";
  EXPECT_EQ(command_calls(server.url(), "hgetall") - walks_before, 0) << "a script read the whole queue";
  lease->release();
  for (auto& waiter : waiters) waiter.cancel();
}

}  // namespace
