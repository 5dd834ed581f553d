// SPDX-License-Identifier: Apache-2.0
// A redis-server of a test's own (tests/redis), for tests that configure, freeze (SIGSTOP) or
// restart it; the others use the suite's fixture server.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <stdexcept>
#include <string>

#include <gtest/gtest.h>

#include "support/server_tests.hpp"

namespace redis_tests {

using namespace std::chrono_literals;
using server_tests::eventually;
using server_tests::read_first_line;
using server_tests::shell;

// The name's one key (see docs/backends/redis.md, how it works).
inline std::string state_key(const std::string& name) { return "turnstile:{" + name + "}:q"; }

// A test on the suite's fixture server (its URL in url_).
class FixtureServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    url_ = read_first_line(TURNSTILE_REDIS_URL_FILE);
    ASSERT_FALSE(url_.empty()) << "no URL in " << TURNSTILE_REDIS_URL_FILE;
  }
  std::string url_;
};

// A redis-server of the test's own, started with `options` in a directory it controls, so it
// can be shut down without saving and restarted from what that directory holds.
class RedisServer {
 public:
  explicit RedisServer(std::string options) : options_(std::move(options)) {
    char dir[] = "/tmp/turnstile-redis-safety-XXXXXX";
    if (!mkdtemp(dir)) throw std::runtime_error("mkdtemp failed");
    dir_ = dir;
    // A port the kernel just handed out (and we released): free unless someone races us.
    const int probe = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(probe, reinterpret_cast<sockaddr*>(&address), sizeof address);
    socklen_t length = sizeof address;
    getsockname(probe, reinterpret_cast<sockaddr*>(&address), &length);
    port_ = ntohs(address.sin_port);
    close(probe);
    start();
  }
  ~RedisServer() {
    signal(SIGCONT);  // a test that failed while the server was frozen
    shutdown("NOSAVE");
    std::filesystem::remove_all(dir_);
  }
  std::string url() const { return "redis://127.0.0.1:" + std::to_string(port_); }
  std::string cli(const std::string& arguments) const {
    return shell("redis-cli -p " + std::to_string(port_) + " " + arguments);
  }
  const std::string& dir() const { return dir_; }
  // Sends `sig` to the server process (SIGSTOP freezes it: connections stay open, nothing answers).
  void signal(int sig) const {
    const auto pid = read_first_line(dir_ + "/redis.pid");
    if (!pid.empty()) kill(std::stoi(pid), sig);
  }
  // Clients waiting on the server (paused by CLIENT PAUSE, or blocked).
  int blocked_clients() const {
    const auto info = cli("INFO clients");
    const auto at = info.find("blocked_clients:");
    return at == std::string::npos ? -1 : std::atoi(info.c_str() + at + 16);
  }
  void start() {
    shell("redis-server --bind 127.0.0.1 --port " + std::to_string(port_) + " --daemonize yes --dir " + dir_ +
          " --pidfile " + dir_ + "/redis.pid --logfile " + dir_ + "/redis.log " + options_);
    if (!eventually([&] { return cli("PING") == "PONG"; }, 10s)) throw std::runtime_error("redis-server did not start");
  }
  // SHUTDOWN NOSAVE (the data since the last snapshot is lost) or SAVE; waits until it is gone.
  void shutdown(const std::string& how) {
    cli("SHUTDOWN " + how);
    eventually([&] { return cli("PING") != "PONG"; }, 10s);
  }

 private:
  std::string options_;
  std::string dir_;
  int port_ = 0;
};

// Continues a frozen server when it goes out of scope.
struct Thaw {
  const RedisServer& server;
  ~Thaw() { server.signal(SIGCONT); }
};

}  // namespace redis_tests
