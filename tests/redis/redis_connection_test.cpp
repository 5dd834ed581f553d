// SPDX-License-Identifier: Apache-2.0
// The Redis backend's connection layer (src/backends/redis/connection.cpp and below, subscriber.cpp),
// against real redis-servers configured as operators run them (maxmemory, replicas, ACL users,
// `timeout`), a loopback proxy that cuts the link, and a test peer that answers like a hostile
// server: calls never wait past their own deadline, error replies are typed errors and never
// crash, an idle connection the server dropped is no "unknown outcome", ACL users are checked at
// connect, sockets are close-on-exec, passwords never appear in errors, replies are bounded.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <future>
#include <mutex>
#include <thread>

#include "backends/redis/connection.hpp"
#include "backends/redis/subscriber.hpp"
#include "support/server_tests.hpp"
#include "support/tcp_proxy.hpp"

namespace {

using namespace std::chrono_literals;
using namespace server_tests;
using turnstile::Client;
namespace redis = turnstile::detail::redis;
using Clock = std::chrono::steady_clock;

redis::Settings settings_for(const std::string& url) {
  return redis::parse_settings(turnstile::detail::parse_url(url), turnstile::ClientOptions{});
}

const redis::Script kIncr{"incr", "return redis.call('INCR', KEYS[1])"};
const redis::Script kGet{"get", "return redis.call('GET', KEYS[1])"};
const redis::Script kPublish{"publish", "return redis.call('PUBLISH', ARGV[1], 'x')"};
const redis::Script kBroken{"broken", "return redis.call('NO-SUCH-COMMAND')"};
const std::vector<const redis::Script*> kScripts{&kIncr, &kGet, &kPublish, &kBroken};

std::string key_for(const std::string& leaf) { return "turnstile:{" + unique_name(leaf) + "}:n"; }

template <class Error, class F>
std::string error_of(F&& call) {
  try {
    call();
  } catch (const Error& error) {
    return error.what();
  } catch (const std::exception& error) {
    ADD_FAILURE() << "wrong error type: " << error.what();
    return error.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

// A test peer on 127.0.0.1: accepts one connection, reads the client's first request, answers
// `answer`, then (when `stream` > 0) keeps sending zero bytes until the client closes the
// connection or `stream` bytes went out. Counts what it sent.
class Peer {
 public:
  Peer(std::string answer, std::size_t stream = 0) {
    listener_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof address);
    listen(listener_, 4);
    socklen_t length = sizeof address;
    getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length);
    port_ = ntohs(address.sin_port);
    thread_ = std::thread([this, answer = std::move(answer), stream] {
      const int connection = accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (connection < 0) return;
      char request[65536];
      [[maybe_unused]] auto got = recv(connection, request, sizeof request, 0);
      send(connection, answer.data(), answer.size(), MSG_NOSIGNAL);
      const std::string chunk(1 << 20, '\0');
      while (sent_ < stream) {
        const auto n = send(connection, chunk.data(), chunk.size(), MSG_NOSIGNAL);
        if (n <= 0) break;
        sent_ += static_cast<std::size_t>(n);
      }
      // Wait for the client to close (or give up after a while) before closing our side.
      char byte;
      timeval patience{10, 0};
      setsockopt(connection, SOL_SOCKET, SO_RCVTIMEO, &patience, sizeof patience);
      while (recv(connection, &byte, 1, 0) > 0) {
      }
      close(connection);
    });
  }
  ~Peer() {
    shutdown(listener_, SHUT_RDWR);
    thread_.join();
    close(listener_);
  }
  std::string url(const std::string& userinfo = "") const {
    return "redis://" + userinfo + "127.0.0.1:" + std::to_string(port_);
  }
  std::size_t sent() const { return sent_; }
  void join() {
    thread_.join();
    thread_ = std::thread([] {});
  }

 private:
  int listener_ = -1;
  std::uint16_t port_ = 0;
  std::atomic<std::size_t> sent_{0};
  std::thread thread_;
};

class RedisConnection : public ::testing::Test {
 protected:
  void SetUp() override {
    url_ = read_first_line(TURNSTILE_REDIS_URL_FILE);
    ASSERT_FALSE(url_.empty()) << "no URL in " << TURNSTILE_REDIS_URL_FILE;
  }
  std::string url_;
};

// Issue 10.2: a call with a short deadline (a release, a renewal) neither waits for another
// thread's stuck round trip nor for its reconnect: it gives up by its own deadline.
TEST_F(RedisConnection, NoCallWaitsPastItsOwnDeadlineBehindAnother) {
  turnstile_test::TcpProxy proxy(url_);
  redis::Connection connection(settings_for(proxy.url_through(url_)), kScripts, {});
  const auto key = key_for("deadline");
  EXPECT_EQ(connection.eval(kIncr, {key}, {}, {.budget = turnstile::Deadline(Clock::now() + 5s), .idempotent = true})
                ->integer,
            1);
  proxy.blackhole();
  std::atomic<bool> long_call_done{false};
  auto long_call = std::async(std::launch::async, [&] {
    try {
      connection.eval(kIncr, {key}, {}, {.budget = turnstile::Deadline(Clock::now() + 4s), .idempotent = true});
    } catch (const turnstile::BackendUnavailable&) {
    }
    long_call_done = true;
  });
  std::this_thread::sleep_for(200ms);
  ASSERT_FALSE(long_call_done) << "the long call should be stuck on the cut link";
  const auto start = Clock::now();
  EXPECT_THROW(
      connection.eval(kGet, {key}, {}, {.budget = turnstile::Deadline(Clock::now() + 300ms), .idempotent = true}),
      turnstile::BackendUnavailable);
  const auto took = Clock::now() - start;
  EXPECT_FALSE(long_call_done) << "the short call must not have waited for the long one";
  EXPECT_LT(took, 1500ms) << "a 300 ms call waited "
                          << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                          << " ms behind another";
  proxy.forward();
  long_call.get();
  // The link heals: calls go through again.
  EXPECT_NO_THROW(
      connection.eval(kGet, {key}, {}, {.budget = turnstile::Deadline(Clock::now() + 5s), .idempotent = true}));
}

// Issue 16.3: every error reply is a typed error; in a pipeline, each call gets its own.
TEST(RedisConnectionOwnServer, ErrorRepliesBecomeTypedErrors) {
  OwnServer server(TURNSTILE_REDIS_SCRIPT);
  redis::Connection connection(settings_for(server.url()), kScripts, {});
  const auto key = key_for("errors");
  const auto soon = [] { return Clock::now() + 5s; };
  EXPECT_EQ(connection.eval(kIncr, {key}, {}, {.budget = turnstile::Deadline(soon())})->integer, 1);

  // OOM under maxmemory + noeviction (the default policy).
  ASSERT_EQ(redis_cli(server.url(), "CONFIG SET maxmemory 1"), "OK");
  EXPECT_NE(error_of<turnstile::BackendUnavailable>([&] {
              connection.eval(kIncr, {key}, {}, {.budget = turnstile::Deadline(soon()), .idempotent = true});
            }).find("OOM"),
            std::string::npos);
  auto results = connection.eval_each({{&kIncr, {key}, {}}, {&kGet, {key}, {}}}, turnstile::Deadline(soon()));
  ASSERT_EQ(results.size(), 2u);
  EXPECT_THROW(results[0].take(), turnstile::BackendUnavailable);
  ASSERT_TRUE(results[1].ok()) << "a read-only script still runs under OOM";
  EXPECT_EQ(std::string(results[1].reply->str, results[1].reply->len), "1");
  EXPECT_THROW(connection.eval_pipelined({{&kIncr, {key}, {}}}, turnstile::Deadline(soon())),
               turnstile::BackendUnavailable);
  ASSERT_EQ(redis_cli(server.url(), "CONFIG SET maxmemory 0"), "OK");

  // A script error.
  EXPECT_THROW(connection.eval(kBroken, {key}, {}, {.budget = turnstile::Deadline(soon()), .idempotent = true}),
               turnstile::BackendUnavailable);

  // BUSY: another connection runs a script that does not end.
  ASSERT_EQ(redis_cli(server.url(), "CONFIG SET busy-reply-threshold 100"), "OK");
  auto busy = std::async(std::launch::async, [&] { return redis_cli(server.url(), "EVAL 'while true do end' 0"); });
  ASSERT_TRUE(eventually([&] { return redis_cli(server.url(), "PING").find("BUSY") != std::string::npos; }));
  EXPECT_NE(error_of<turnstile::BackendUnavailable>([&] {
              connection.eval(kIncr, {key}, {}, {.budget = turnstile::Deadline(soon()), .idempotent = true});
            }).find("BUSY"),
            std::string::npos);
  redis_cli(server.url(), "SCRIPT KILL");
  busy.get();

  // An ACL user whose channel rights were taken away after it connected.
  const auto user = "pub" + std::to_string(getpid());
  ASSERT_EQ(redis_cli(server.url(), "ACL SETUSER " + user + " on '>pw' '~*' '&*' '+@all'"), "OK");
  const auto hostport = server.url().substr(std::string("redis://").size());
  redis::Connection limited(settings_for("redis://" + user + ":pw@" + hostport), kScripts, {});
  ASSERT_EQ(redis_cli(server.url(), "ACL SETUSER " + user + " resetchannels"), "OK");
  EXPECT_THROW(
      limited.eval(kPublish, {}, {"turnstile:{x}:w"}, {.budget = turnstile::Deadline(soon()), .idempotent = true}),
      turnstile::AccessDenied);

  // READONLY after a demotion to replica of another server.
  OwnServer primary(TURNSTILE_REDIS_SCRIPT);
  const auto primary_port = primary.url().substr(primary.url().rfind(':') + 1);
  ASSERT_EQ(redis_cli(server.url(), "REPLICAOF 127.0.0.1 " + primary_port), "OK");
  EXPECT_NE(error_of<turnstile::BackendUnavailable>([&] {
              connection.eval(kIncr, {key}, {}, {.budget = turnstile::Deadline(soon()), .idempotent = true});
            }).find("READONLY"),
            std::string::npos);
  // And a new connection to a replica is refused at connect.
  EXPECT_THROW(redis::Connection(settings_for(server.url()), kScripts, {}), turnstile::BackendUnavailable);
  ASSERT_EQ(redis_cli(server.url(), "REPLICAOF NO ONE"), "OK");
}

// Issue 16.3, the holder's side: renewals answered with error replies (OOM, BUSY) suspend the
// hold (or lose it); they never crash the process (an exception escaping the watchdog did).
TEST(RedisConnectionOwnServer, ErrorRepliesToRenewalsDoNotCrashTheHolder) {
  OwnServer server(TURNSTILE_REDIS_SCRIPT);
  auto client = Client::connect(server.url(), with_ttl(900ms));
  auto mutex = client.mutex(unique_name("renew-errors"));
  mutex.lock();
  ASSERT_EQ(redis_cli(server.url(), "CONFIG SET maxmemory 1"), "OK");
  EXPECT_TRUE(eventually([&] { return mutex.hold_state() != turnstile::HoldState::held; }, 5s));
  ASSERT_EQ(redis_cli(server.url(), "CONFIG SET maxmemory 0"), "OK");
  mutex.unlock();
}

// Issue 16.6: a connection the server closed while idle (`timeout 1`) is no "outcome unknown":
// the call goes out on a new connection, exactly once.
TEST(RedisConnectionOwnServer, ConnectionClosedWhileIdleIsNoUnknownOutcome) {
  OwnServer server(TURNSTILE_REDIS_SCRIPT);
  ASSERT_EQ(redis_cli(server.url(), "CONFIG SET timeout 1"), "OK");
  auto client = Client::connect(server.url());
  auto counter = client.permit_counter(unique_name("idle"));
  EXPECT_EQ(counter.add_permits(1), 1);
  // The server closed our idle command connection (the only one that ran scripts).
  ASSERT_TRUE(
      eventually([&] { return redis_cli(server.url(), "CLIENT LIST").find("cmd=evalsha") == std::string::npos; }, 10s));
  EXPECT_EQ(counter.add_permits(1), 2);
  EXPECT_EQ(counter.available_permits(), 2);
}

// Issue 16.6: a link that went silent while idle (a NAT dropped it) is probed before anything
// that must not be resent is written: the call fails without having been sent, not "unknown".
TEST_F(RedisConnection, SilentIdleLinkIsProbedBeforeANonIdempotentCall) {
  turnstile_test::TcpProxy proxy(url_);
  redis::Connection connection(settings_for(proxy.url_through(url_)), kScripts, {});
  const auto key = key_for("silent");
  EXPECT_EQ(connection.eval(kIncr, {key}, {}, {.budget = turnstile::Deadline(Clock::now() + 5s)})->integer, 1);
  std::this_thread::sleep_for(redis::kIdleProbe + 100ms);
  proxy.blackhole();
  const auto error = error_of<turnstile::BackendUnavailable>(
      [&] { connection.eval(kIncr, {key}, {}, {.budget = turnstile::Deadline(Clock::now() + 500ms)}); });
  EXPECT_EQ(error.find("unknown"), std::string::npos) << error;
  proxy.forward();
  std::this_thread::sleep_for(200ms);  // what the proxy held back is delivered now
  EXPECT_EQ(redis_cli(url_, "GET " + quoted(key)), "1") << "the call was sent after all";
}

// Issue 16.7: a user lacking a permission the backend needs is refused at Client::connect,
// with nothing written.
TEST(RedisConnectionOwnServer, ConnectChecksEveryPermissionTheBackendNeeds) {
  OwnServer server(TURNSTILE_REDIS_SCRIPT);
  const auto hostport = server.url().substr(std::string("redis://").size());
  const std::vector<std::pair<std::string, std::string>> users{
      {"nochannels", "'~*' resetchannels '+@all'"},       // Redis 7's default for new users
      {"nokeys", "'~other:*' '&*' '+@all'"},              // not turnstile's keys
      {"readonly", "'%R~*' '&*' '+@all'"},                // keys it may read only
      {"nosubscribe", "'~*' '&*' '+@all' '-subscribe'"},  // cannot wait for wake-ups
      {"noscripts", "'~*' '&*' '+@all' '-@scripting'"},
  };
  for (const auto& [user, rules] : users) {
    ASSERT_EQ(redis_cli(server.url(), "ACL SETUSER " + user + " on '>pw' " + rules), "OK");
    EXPECT_THROW(Client::connect("redis://" + user + ":pw@" + hostport), turnstile::AccessDenied) << user;
  }
  ASSERT_EQ(redis_cli(server.url(), "ACL SETUSER all on '>pw' '~*' '&*' '+@all'"), "OK");
  EXPECT_NO_THROW(Client::connect("redis://all:pw@" + hostport));
  EXPECT_EQ(redis_cli(server.url(), "DBSIZE"), "0") << "a connect check wrote something";
}

// Issue 16.8: a child that a connected client forks and execs inherits none of its sockets.
TEST_F(RedisConnection, SocketsAreCloseOnExec) {
  auto client = Client::connect(url_);
  auto mutex = client.mutex(unique_name("cloexec"));
  mutex.lock();
  const auto sockets = [](const std::string& listing) {
    std::size_t count = 0;
    for (auto at = listing.find("socket:"); at != std::string::npos; at = listing.find("socket:", at + 1)) ++count;
    return count;
  };
  // Ours: the command connection and the subscriber's (made by its thread).
  ASSERT_TRUE(eventually([&] { return sockets(shell("ls -l /proc/" + std::to_string(getpid()) + "/fd")) >= 2; }));
  EXPECT_EQ(sockets(shell("ls -l /proc/self/fd")), 0u) << shell("ls -l /proc/self/fd");
  mutex.unlock();
}

// Issue 10.13: no error message shows a password, whatever failed.
TEST_F(RedisConnection, PasswordsNeverAppearInErrors) {
  const auto hostport = url_.substr(std::string("redis://").size());
  const std::string secret = "s3cret-Pw";
  const auto user = "pw" + std::to_string(getpid());
  ASSERT_EQ(redis_cli(url_, "ACL SETUSER " + user + " on '>right' '~*' '&*' '+@all'"), "OK");
  const auto refused =
      error_of<turnstile::AccessDenied>([&] { Client::connect("redis://" + user + ":" + secret + "@" + hostport); });
  EXPECT_EQ(refused.find(secret), std::string::npos) << refused;
  const auto no_password_set =
      error_of<turnstile::AccessDenied>([&] { Client::connect("redis://:" + secret + "@" + hostport); });
  EXPECT_EQ(no_password_set.find(secret), std::string::npos) << no_password_set;
  redis_cli(url_, "ACL DELUSER " + user);

  int port;
  {
    Peer closed("");
    port = std::stoi(closed.url().substr(closed.url().rfind(':') + 1));
  }
  const auto unreachable = error_of<turnstile::BackendUnavailable>(
      [&] { Client::connect("redis://u:" + secret + "@127.0.0.1:" + std::to_string(port)); });
  EXPECT_EQ(unreachable.find(secret), std::string::npos) << unreachable;
  const auto bad_url =
      error_of<turnstile::InvalidUrl>([&] { Client::connect("redis://u:" + secret + "@127.0.0.1:1/x"); });
  EXPECT_EQ(bad_url.find(secret), std::string::npos) << bad_url;
  // A server that repeats the password in its error: masked.
  std::string answers = "-WRONGPASS the password " + secret + " is wrong\r\n";
  for (int i = 0; i < 100; ++i) answers += "-NOAUTH Authentication required.\r\n";
  Peer echo(answers);
  const auto echoed = error_of<turnstile::AccessDenied>([&] { Client::connect(echo.url("u:" + secret + "@")); });
  EXPECT_EQ(echoed.find(secret), std::string::npos) << echoed;
}

// Issue 10.15: a server announcing a huge reply cannot make us buffer or allocate it.
TEST(RedisConnectionPeer, OversizedRepliesAreRefused) {
#if defined(__SANITIZE_ADDRESS__)
  // Under AddressSanitizer, reading up to the 64 MiB limit takes about the 5 s reply timeout
  // (10.7 s for this test alone, 0.5 s in the plain build), so the handshake may end "no answer
  // in time" first. Shown as skipped, not hidden; the plain build runs it.
  GTEST_SKIP() << "under ASan reading 64 MiB takes about the reply timeout: see the comment";
#endif
  constexpr std::size_t kOffered = std::size_t{160} << 20;
  {
    Peer huge_string("$100000000000\r\n", kOffered);
    const auto error = error_of<turnstile::BackendUnavailable>([&] { Client::connect(huge_string.url()); });
    EXPECT_NE(error.find("larger than"), std::string::npos) << error;
    huge_string.join();
    EXPECT_LT(huge_string.sent(), redis::kMaxReplyBytes + (std::size_t{32} << 20))
        << "the client read far more than its limit before giving up";
  }
  {
    Peer huge_array("*2000000000\r\n");
    const auto error = error_of<turnstile::BackendUnavailable>([&] { Client::connect(huge_array.url()); });
    EXPECT_NE(error.find("larger than"), std::string::npos) << error;
  }
}

// Nothing throws out of the subscriber thread: a callback that throws loses its message, not
// the process, and later messages still arrive.
TEST_F(RedisConnection, SubscriberThreadSurvivesThrowingCallbacks) {
  const auto channel = "turnstile:{" + unique_name("sub") + "}:w";
  std::atomic<int> messages{0};
  redis::Subscriber subscriber(settings_for(url_),
                               {.on_message =
                                    [&](const std::string&, const std::string&) {
                                      ++messages;
                                      throw std::runtime_error("a waiter table in trouble");
                                    },
                                .on_reset = [] { throw std::runtime_error("reset in trouble"); },
                                .on_confirmed = [](const std::string&) { throw std::runtime_error("confirmed"); },
                                .on_turn = [] { throw std::runtime_error("turn in trouble"); }});
  ASSERT_TRUE(subscriber.subscribe(channel, Clock::now() + 5s));
  redis_cli(url_, "PUBLISH " + quoted(channel) + " 1");
  ASSERT_TRUE(eventually([&] { return messages == 1; }));
  redis_cli(url_, "PUBLISH " + quoted(channel) + " 2");
  EXPECT_TRUE(eventually([&] { return messages == 2; }));
  subscriber.unsubscribe(channel);
}

// The error codes a server (or a Redis Cluster, or a script) answers, read from the wire by
// hiredis' own reader, and the typed errors they become.
TEST(RedisConnectionPeer, ErrorCodesMapToTypedErrors) {
  const auto settings = settings_for("redis://u:hunter22@127.0.0.1:1");
  const auto parse = [](const std::string& bytes) {
    redisReader* reader = redisReaderCreate();
    redisReaderFeed(reader, bytes.data(), bytes.size());
    void* reply = nullptr;
    redisReaderGetReply(reader, &reply);
    redisReaderFree(reader);
    return redis::Reply(static_cast<redisReply*>(reply));
  };
  const auto kind = [&](const std::string& bytes) {
    const auto reply = parse(bytes);
    const auto error = redis::reply_error(settings, "script x", reply.get());
    if (!error) return std::string("none");
    try {
      std::rethrow_exception(error);
    } catch (const turnstile::AccessDenied& e) {
      EXPECT_EQ(std::string(e.what()).find("hunter22"), std::string::npos);
      return std::string("denied");
    } catch (const turnstile::BackendUnavailable& e) {
      EXPECT_EQ(std::string(e.what()).find("hunter22"), std::string::npos);
      return std::string("unavailable");
    }
  };
  for (const char* code : {"NOPERM", "NOAUTH", "WRONGPASS"})
    EXPECT_EQ(kind(std::string("-") + code + " no hunter22\r\n"), "denied");
  EXPECT_EQ(kind("-ERR The user executing the script can't publish to the channel mentioned\r\n"), "denied");
  for (const char* code :
       {"OOM", "READONLY", "MASTERDOWN", "CLUSTERDOWN", "MOVED", "ASK", "BUSY", "MISCONF", "LOADING", "ERR"}) {
    EXPECT_EQ(kind(std::string("-") + code + " something\r\n"), "unavailable") << code;
  }
  EXPECT_EQ(kind("*2\r\n:1\r\n-OOM nested\r\n"), "unavailable");
  EXPECT_EQ(kind("*2\r\n:1\r\n$2\r\nok\r\n"), "none");
  EXPECT_EQ(redis::redacted(settings, "a hunter22 b\x1b[31m"), "a *** b?[31m");
}

// Issue 25: a script call sent without waiting (a pipelined release) is answered exactly once,
// in order: the next call on the connection goes out after it and reads its reply first, so
// that call sees what it did; with no next call, collect_pending() reads it.
struct Answers {
  std::mutex mutex;
  std::vector<long long> values;  // -1 for an error
  std::vector<std::string> errors;
  redis::Answer answer() {
    return [this](redis::Result result) {
      std::lock_guard lock(mutex);
      if (result.ok()) {
        values.push_back(result.reply->integer);
        return;
      }
      values.push_back(-1);
      try {
        std::rethrow_exception(result.error);
      } catch (const turnstile::BackendUnavailable& error) {
        errors.push_back(error.what());
      } catch (...) {
        errors.push_back("not BackendUnavailable");
      }
    };
  }
  std::vector<long long> seen() {
    std::lock_guard lock(mutex);
    return values;
  }
};

TEST_F(RedisConnection, PipelinedCallsAreAnsweredInOrderBeforeTheNextCall) {
  redis::Connection connection(settings_for(url_), kScripts, {});
  const auto key = key_for("pipelined");
  const redis::CallOptions options{.budget = turnstile::Deadline(Clock::now() + 5s), .idempotent = true};
  ASSERT_EQ(connection.eval(kIncr, {key}, {}, options)->integer, 1);  // loads the scripts
  Answers answers;
  ASSERT_TRUE(connection.send_pipelined(kIncr, {key}, {}, answers.answer()));
  ASSERT_TRUE(connection.send_pipelined(kIncr, {key}, {}, answers.answer()));
  // Sent, not waited for: the next call on the connection reads both replies before its own.
  const auto value = connection.eval(kGet, {key}, {}, options);
  ASSERT_EQ(value->type, REDIS_REPLY_STRING);
  EXPECT_EQ(std::string(value->str, value->len), "3") << "the pipelined calls ran before the next call";
  EXPECT_EQ(answers.seen(), (std::vector<long long>{2, 3})) << "each answered once, in order, by then";
  connection.collect_pending(Clock::now() + 1s);
  EXPECT_EQ(answers.seen().size(), 2u) << "answered exactly once";
}

TEST_F(RedisConnection, CollectPendingAnswersAPipelinedCallWithoutAnotherCall) {
  redis::Connection connection(settings_for(url_), kScripts, {});
  const auto key = key_for("collected");
  ASSERT_EQ(connection.eval(kIncr, {key}, {}, {.budget = turnstile::Deadline(Clock::now() + 5s)})->integer, 1);
  Answers answers;
  ASSERT_TRUE(connection.send_pipelined(kIncr, {key}, {}, answers.answer()));
  connection.collect_pending(Clock::now() + 5s);
  EXPECT_EQ(answers.seen(), (std::vector<long long>{2}));
}

// A pipelined call whose reply never comes (the link cut after it went out) is an unknown
// outcome (BackendUnavailable), answered once, by collect_pending's deadline; and a Connection
// ending with a reply owed answers it too.
TEST_F(RedisConnection, PipelinedCallOnABrokenLinkIsAnsweredAsUnknownOnce) {
  turnstile_test::TcpProxy proxy(url_);
  const auto key = key_for("pipelined-cut");
  Answers answers;
  {
    redis::Connection connection(settings_for(proxy.url_through(url_)), kScripts, {});
    ASSERT_EQ(connection.eval(kIncr, {key}, {}, {.budget = turnstile::Deadline(Clock::now() + 5s)})->integer, 1);
    proxy.drop_replies();
    ASSERT_TRUE(connection.send_pipelined(kIncr, {key}, {}, answers.answer()));
    connection.collect_pending(Clock::now() + 300ms);
    ASSERT_EQ(answers.seen(), (std::vector<long long>{-1}));
    EXPECT_NE(answers.errors.front().find("outcome is unknown"), std::string::npos) << answers.errors.front();
    proxy.forward();
    ASSERT_EQ(connection.eval(kIncr, {key}, {}, {.budget = turnstile::Deadline(Clock::now() + 5s)})->integer, 3);
    proxy.hold_replies();
    ASSERT_TRUE(connection.send_pipelined(kIncr, {key}, {}, answers.answer()));
    ASSERT_EQ(answers.seen().size(), 1u) << "not answered before its reply or its connection's end";
  }
  EXPECT_EQ(answers.seen(), (std::vector<long long>{-1, -1})) << "the Connection's end answers what it owed";
  proxy.forward();
}

}  // namespace
