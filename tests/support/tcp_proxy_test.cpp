// SPDX-License-Identifier: Apache-2.0
// The test proxy itself, against a local echo server: each mode does what the failure tests
// rely on it to do.
#include "support/tcp_proxy.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace {

using namespace std::chrono_literals;
using turnstile_test::TcpProxy;

// Echoes every byte back on every connection; counts and logs what it received.
class EchoServer {
 public:
  EchoServer() {
    listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof address);
    ::listen(listener_, 16);
    socklen_t size = sizeof address;
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &size);
    port_ = ntohs(address.sin_port);
    thread_ = std::thread([this] { run(); });
  }
  ~EchoServer() {
    stop_ = true;
    thread_.join();
    for (int fd : clients_) ::close(fd);
    ::close(listener_);
  }
  std::uint16_t port() const { return port_; }
  std::size_t received() const { return received_.load(); }
  std::size_t connections() const { return connections_.load(); }
  // Every byte received, in the order read (all connections).
  std::string log() const {
    std::lock_guard lock(log_mutex_);
    return log_;
  }

 private:
  void run() {
    while (!stop_) {
      std::vector<pollfd> fds{{listener_, POLLIN, 0}};
      for (int fd : clients_) fds.push_back({fd, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 20) <= 0) continue;
      if (fds[0].revents & POLLIN) {
        clients_.push_back(::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC));
        connections_.fetch_add(1);
      }
      for (std::size_t i = 1; i < fds.size(); ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        char buffer[4096];
        const auto n = ::read(fds[i].fd, buffer, sizeof buffer);
        if (n <= 0) {
          ::close(fds[i].fd);
          std::erase(clients_, fds[i].fd);
          continue;
        }
        received_.fetch_add(n);
        {
          std::lock_guard lock(log_mutex_);
          log_.append(buffer, n);
        }
        (void)!::write(fds[i].fd, buffer, n);
      }
    }
  }
  int listener_ = -1;
  std::uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<std::size_t> received_{0};
  std::atomic<std::size_t> connections_{0};
  std::vector<int> clients_;
  mutable std::mutex log_mutex_;
  std::string log_;
  std::thread thread_;
};

int connect_to(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(port);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

void send_text(int fd, const std::string& text) {
  ASSERT_EQ(::write(fd, text.data(), text.size()), static_cast<ssize_t>(text.size()));
}

// What arrives on fd within `wait` (stops early once `expected` bytes came); "<closed>" or
// "<reset>" appended when the connection ended.
std::string receive(int fd, std::size_t expected, std::chrono::milliseconds wait) {
  std::string text;
  const auto deadline = std::chrono::steady_clock::now() + wait;
  while (text.size() < expected) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left <= 0ms) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
    char buffer[4096];
    const auto n = ::read(fd, buffer, sizeof buffer);
    if (n == 0) return text + "<closed>";
    if (n < 0) return text + (errno == ECONNRESET ? "<reset>" : "<error>");
    text.append(buffer, n);
  }
  return text;
}

bool eventually(const std::function<bool()>& predicate, std::chrono::milliseconds timeout = 5s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!predicate()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

// An echo server behind a proxy; open() connects through the proxy and checks one round trip.
class TcpProxyTest : public ::testing::Test {
 protected:
  int open() {
    const int fd = connect_to(proxy.port());
    EXPECT_GE(fd, 0);
    send_text(fd, "a");
    EXPECT_EQ(receive(fd, 1, 5s), "a");
    fds_.push_back(fd);
    return fd;
  }
  void TearDown() override {
    for (int fd : fds_) ::close(fd);
  }
  EchoServer echo;
  TcpProxy proxy{"127.0.0.1", echo.port()};

 private:
  std::vector<int> fds_;
};

TEST_F(TcpProxyTest, ForwardsBothWays) {
  const int fd = connect_to(proxy.port());
  ASSERT_GE(fd, 0);
  send_text(fd, "hello");
  EXPECT_EQ(receive(fd, 5, 5s), "hello");
  ::close(fd);
  EXPECT_TRUE(eventually([&] { return proxy.open_connections() == 0; })) << "a closed connection is closed onwards";
}

TEST_F(TcpProxyTest, BlackholeKeepsSocketsOpenAndForwardsNothingUntilItHeals) {
  const int fd = open();

  proxy.blackhole();
  send_text(fd, "b");
  EXPECT_EQ(receive(fd, 1, 300ms), "") << "no answer, no FIN, no reset through a cut link";
  EXPECT_EQ(echo.received(), 1u);
  const int late = connect_to(proxy.port());
  ASSERT_GE(late, 0) << "new connections are still accepted";
  send_text(late, "c");
  EXPECT_EQ(receive(late, 1, 300ms), "");
  EXPECT_EQ(echo.connections(), 1u) << "and not connected onwards";
  EXPECT_EQ(proxy.open_connections(), 2u);

  proxy.forward();
  EXPECT_EQ(receive(fd, 1, 5s), "b") << "what was sent during the cut arrives once it heals";
  EXPECT_EQ(receive(late, 1, 5s), "c");
  ::close(late);
}

TEST_F(TcpProxyTest, BlackholeWhenQuietCutsAfterALull) {
  const int fd = open();
  const auto cut = proxy.blackhole_when_quiet(50ms);
  EXPECT_EQ(proxy.mode(), TcpProxy::Mode::blackhole);
  EXPECT_LE(proxy.last_request_at(), cut - 50ms);
  EXPECT_GT(proxy.last_request_at().time_since_epoch().count(), 0) << "the round trip of open() was seen";
  send_text(fd, "b");
  EXPECT_EQ(receive(fd, 1, 100ms), "");
}

TEST_F(TcpProxyTest, DropRepliesDeliversRequestsButNotReplies) {
  const int fd = open();

  proxy.drop_replies();
  send_text(fd, "bb");
  EXPECT_TRUE(eventually([&] { return echo.received() == 3; })) << "the request reaches the server";
  EXPECT_TRUE(eventually([&] { return proxy.dropped_bytes() == 2; })) << "its reply is read and dropped";
  EXPECT_EQ(receive(fd, 1, 200ms), "");

  proxy.forward();
  send_text(fd, "c");
  EXPECT_EQ(receive(fd, 1, 5s), "c") << "the dropped reply never arrives, later ones do";
}

TEST_F(TcpProxyTest, HoldRepliesPassesThemOneByOneThenDropsTheRest) {
  const int fd = open();
  proxy.hold_replies();
  send_text(fd, "b");
  EXPECT_TRUE(eventually([&] { return echo.received() == 2; })) << "requests still flow";
  EXPECT_EQ(receive(fd, 1, 100ms), "") << "replies wait";
  EXPECT_TRUE(proxy.pass_one_reply(2s));
  EXPECT_EQ(receive(fd, 1, 2s), "b");
  EXPECT_FALSE(proxy.pass_one_reply(100ms)) << "no reply waiting";
  send_text(fd, "c");
  EXPECT_TRUE(eventually([&] { return echo.received() == 3; }));
  proxy.drop_replies();
  EXPECT_TRUE(eventually([&] { return proxy.dropped_bytes() == 1; })) << "the held reply is dropped";
  proxy.forward();
  send_text(fd, "d");
  EXPECT_EQ(receive(fd, 1, 2s), "d");
}

TEST_F(TcpProxyTest, DropNextReplyDropsOneChunkOnly) {
  const int fd = open();
  proxy.drop_next_reply();
  send_text(fd, "a");
  EXPECT_TRUE(eventually([&] { return proxy.dropped_bytes() == 1; }));
  send_text(fd, "b");
  EXPECT_EQ(receive(fd, 1, 5s), "b");
  EXPECT_EQ(receive(fd, 1, 100ms), "") << "and the dropped one never arrives";
}

TEST_F(TcpProxyTest, ResetClosesCurrentConnectionsAndKeepsAccepting) {
  const int fd = open();
  proxy.reset();
  EXPECT_EQ(receive(fd, 1, 5s), "<reset>");
  const int again = connect_to(proxy.port());
  send_text(again, "b");
  EXPECT_EQ(receive(again, 1, 5s), "b");
  ::close(again);
}

// The nth chunk counts over all connections; from it on, that connection's requests wait.
TEST_F(TcpProxyTest, HoldRequestKeepsTheNthMatchingChunkAndTheRestOfItsConnection) {
  const int first = open();
  const int second = open();
  const auto hold = proxy.hold_request("KEY", 2);
  send_text(first, "set KEY 1;");
  EXPECT_EQ(receive(first, 10, 5s), "set KEY 1;") << "the first match flows";
  EXPECT_FALSE(hold->held());
  send_text(second, "set KEY 2;");
  ASSERT_TRUE(hold->wait_held(5s)) << "the second match is held";
  send_text(second, "get;");
  EXPECT_EQ(receive(second, 1, 300ms), "") << "nothing of the held connection reaches the server";
  EXPECT_EQ(echo.log().find("2;"), std::string::npos);

  send_text(first, "set KEY 3;");
  EXPECT_EQ(receive(first, 10, 5s), "set KEY 3;") << "other connections flow, even with the pattern";
  const int third = open();
  send_text(third, "x");
  EXPECT_EQ(receive(third, 1, 5s), "x") << "and new ones";

  hold->deliver();
  EXPECT_EQ(receive(second, 14, 5s), "set KEY 2;get;") << "everything kept back, in order";
  send_text(second, "KEY again");
  EXPECT_EQ(receive(second, 9, 5s), "KEY again") << "then it flows again";
  EXPECT_TRUE(hold->held());
  ::close(third);
}

// A client's cancel sent after its request must not overtake it on delivery: the held chunk
// goes first, what followed it a second later.
TEST_F(TcpProxyTest, DeliveryLetsTheHeldChunkGoFirstAndTheRestFollowLater) {
  const int fd = open();
  const auto hold = proxy.hold_request("REQUEST");
  send_text(fd, "REQUEST;");
  ASSERT_TRUE(hold->wait_held(5s));
  std::this_thread::sleep_for(50ms);  // a chunk of its own
  send_text(fd, "CANCEL;");
  EXPECT_EQ(receive(fd, 1, 100ms), "");
  hold->deliver();
  EXPECT_EQ(receive(fd, 8, 5s), "REQUEST;");
  EXPECT_EQ(receive(fd, 1, 500ms), "") << "the rest waits";
  EXPECT_EQ(receive(fd, 7, 5s), "CANCEL;") << "then follows";
  send_text(fd, "more;");
  EXPECT_EQ(receive(fd, 5, 5s), "more;");
  EXPECT_EQ(echo.log(), "aREQUEST;CANCEL;more;");
}

TEST_F(TcpProxyTest, HoldRequestMatchesAcrossChunkBoundaries) {
  const int fd = open();
  const auto hold = proxy.hold_request("SPLIT");
  send_text(fd, "..SP");
  EXPECT_EQ(receive(fd, 4, 5s), "..SP") << "half a pattern is no match";
  EXPECT_FALSE(hold->held());
  send_text(fd, "LIT..");
  ASSERT_TRUE(hold->wait_held(5s)) << "the chunk that completes the pattern is held";
  EXPECT_EQ(receive(fd, 1, 200ms), "");
  EXPECT_EQ(echo.log(), "a..SP");
  hold->deliver();
  EXPECT_EQ(receive(fd, 5, 5s), "LIT..");
}

TEST_F(TcpProxyTest, HeldRequestIsDeliveredAfterItsClientClosed) {
  const int gentle = connect_to(proxy.port());
  const int abrupt = connect_to(proxy.port());
  const auto gentle_hold = proxy.hold_request("LATE-1");
  const auto abrupt_hold = proxy.hold_request("LATE-2");
  send_text(gentle, "LATE-1");
  send_text(abrupt, "LATE-2");
  ASSERT_TRUE(gentle_hold->wait_held(5s));
  ASSERT_TRUE(abrupt_hold->wait_held(5s));
  ::close(gentle);  // FIN
  linger reset_on_close{1, 0};
  ::setsockopt(abrupt, SOL_SOCKET, SO_LINGER, &reset_on_close, sizeof reset_on_close);
  ::close(abrupt);  // RST
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(proxy.open_connections(), 2u) << "the server sides stay open while their requests are held";
  EXPECT_EQ(echo.received(), 0u);

  gentle_hold->deliver();
  abrupt_hold->deliver();
  EXPECT_TRUE(eventually([&] { return echo.received() == 12; })) << "the server still gets the late requests";
  EXPECT_EQ(proxy.open_connections(), 2u) << "and time to answer them (answers discarded)";
  EXPECT_TRUE(eventually([&] { return proxy.open_connections() == 0; }, 8s)) << "closed some 5 s later";
}

TEST_F(TcpProxyTest, CutClientResetsTheClientAndKeepsTheRequestForDelivery) {
  const int fd = open();
  const auto hold = proxy.hold_request("RESENT");
  send_text(fd, "RESENT");
  ASSERT_TRUE(hold->wait_held(5s));
  hold->cut_client();
  EXPECT_EQ(receive(fd, 1, 5s), "<reset>") << "the client learns at once";
  const int again = open();  // its resend, on a new connection
  send_text(again, "RESENT");
  EXPECT_EQ(receive(again, 6, 5s), "RESENT") << "not held: the hold caught its one request";
  hold->deliver();
  EXPECT_TRUE(eventually([&] { return echo.log() == "aaRESENTRESENT"; }))
      << "the first copy lands late: " << echo.log();
}

TEST_F(TcpProxyTest, DroppedRequestNeverReachesTheServer) {
  const int fd = open();
  const int other = open();
  const auto hold = proxy.hold_request("DOOMED");
  send_text(fd, "DOOMED");
  ASSERT_TRUE(hold->wait_held(5s));
  hold->drop();
  EXPECT_EQ(receive(fd, 1, 5s), "<reset>");
  send_text(other, "b");
  EXPECT_EQ(receive(other, 1, 5s), "b");
  EXPECT_EQ(echo.log(), "aab") << "nothing of the dropped request";
  hold->deliver();  // too late: nothing left to deliver
  EXPECT_EQ(echo.log(), "aab");
}

TEST_F(TcpProxyTest, DeliverAfterWaitsForALaterRequestAndItsReply) {
  const int held = open();
  const int later = open();
  const auto hold = proxy.hold_request("FIRST");
  send_text(held, "FIRST");
  ASSERT_TRUE(hold->wait_held(5s));
  EXPECT_FALSE(hold->deliver_after("SECOND", 200ms)) << "no later request: nothing delivered";
  EXPECT_EQ(receive(held, 1, 100ms), "");

  std::thread sender([&] {
    std::this_thread::sleep_for(200ms);
    send_text(later, "SECOND");
  });
  EXPECT_TRUE(hold->deliver_after("SECOND", 5s));
  sender.join();
  EXPECT_EQ(receive(later, 6, 5s), "SECOND");
  EXPECT_EQ(receive(held, 5, 5s), "FIRST");
  EXPECT_EQ(echo.log(), "aaSECONDFIRST") << "the held request lands after the later one";
}

TEST_F(TcpProxyTest, HoldDeliveredOrDroppedBeforeItMatchedIsDisarmed) {
  const int fd = open();
  const auto delivered = proxy.hold_request("ONE");
  const auto dropped = proxy.hold_request("TWO");
  delivered->deliver();
  dropped->drop();
  send_text(fd, "ONE TWO");
  EXPECT_EQ(receive(fd, 7, 5s), "ONE TWO");
  EXPECT_FALSE(delivered->held());
  EXPECT_FALSE(dropped->wait_held(10ms));
}

TEST_F(TcpProxyTest, DuplicatedRequestIsForwardedAndReplayedOnANewConnection) {
  const int fd = open();
  const auto copy = proxy.duplicate_request("INCR", 2);
  send_text(fd, "INCR x;");
  EXPECT_EQ(receive(fd, 7, 5s), "INCR x;");
  EXPECT_FALSE(copy->wait_seen(10ms));
  EXPECT_THROW(copy->replay(), std::logic_error);
  send_text(fd, "INCR y;");
  EXPECT_EQ(receive(fd, 7, 5s), "INCR y;") << "the copied request is forwarded as usual";
  ASSERT_TRUE(copy->wait_seen(5s));
  send_text(fd, "more;");
  EXPECT_EQ(receive(fd, 5, 5s), "more;");

  const auto connections = echo.connections();
  copy->replay();
  EXPECT_TRUE(eventually([&] { return echo.log() == "aINCR x;INCR y;more;INCR y;"; })) << echo.log();
  EXPECT_EQ(echo.connections(), connections + 1) << "on a new connection";
  EXPECT_EQ(receive(fd, 1, 200ms), "") << "its reply reaches no client";
  copy->replay();
  EXPECT_TRUE(eventually([&] { return echo.log() == "aINCR x;INCR y;more;INCR y;INCR y;"; })) << "as often as asked";
}

TEST(TcpProxy, LateRequestsOutliveTheProxy) {
  std::shared_ptr<turnstile_test::HeldRequest> hold;
  std::shared_ptr<turnstile_test::DuplicatedRequest> copy;
  {
    EchoServer echo;
    TcpProxy proxy("127.0.0.1", echo.port());
    hold = proxy.hold_request("A");
    copy = proxy.duplicate_request("B");
  }
  EXPECT_FALSE(hold->wait_held(10ms));
  hold->deliver();
  hold->drop();
  EXPECT_FALSE(copy->wait_seen(10ms));
}

TEST(TcpProxy, ShutdownIsPromptEvenWhileBlackholed) {
  EchoServer echo;
  auto proxy = std::make_unique<TcpProxy>("127.0.0.1", echo.port());
  const int fd = connect_to(proxy->port());
  proxy->blackhole();
  proxy.reset();  // joins its thread
  EXPECT_EQ(receive(fd, 1, 5s), "<reset>");
  ::close(fd);
}

TEST(TcpProxy, RewritesOnlyTheHostList) {
  TcpProxy proxy("127.0.0.1", 1);
  const auto at = "127.0.0.1:" + std::to_string(proxy.port());
  EXPECT_EQ(proxy.url_through("redis://user:p%40ss@10.0.0.1:6380/2?ttl=3000"),
            "redis://user:p%40ss@" + at + "/2?ttl=3000");
  EXPECT_EQ(proxy.url_through("zookeeper://a:1,b:2/chroot"), "zookeeper://" + at + "/chroot");
  EXPECT_EQ(proxy.url_through("etcd://127.0.0.1:2379"), "etcd://" + at);
  EXPECT_EQ(proxy.url_through("etcd://h?ttl=1"), "etcd://" + at + "?ttl=1");
  EXPECT_EQ(TcpProxy::endpoint_of("redis://:pw@127.0.0.1:7000/1"),
            std::make_pair(std::string("127.0.0.1"), std::uint16_t{7000}));
  EXPECT_EQ(TcpProxy::endpoint_of("zookeeper://h1,h2:3"), std::make_pair(std::string("h1"), std::uint16_t{2181}));
}

}  // namespace
