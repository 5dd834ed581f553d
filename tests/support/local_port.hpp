// SPDX-License-Identifier: Apache-2.0
// A TCP port of the test's own on 127.0.0.1, for connects that must be refused or left
// unanswered without any server: listening, it is a server that accepts connections (the kernel
// completes them) and never says a word; not listening, it refuses every connection, and stays
// the test's (bound) while it lives.
#pragma once

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

namespace turnstile_test {

class LocalPort {
 public:
  explicit LocalPort(bool listening) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof address;
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&address), length), 0);
    EXPECT_EQ(getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &length), 0);
    port_ = ntohs(address.sin_port);
    if (listening) {
      EXPECT_EQ(listen(fd_, 16), 0);
    }
  }
  ~LocalPort() {
    for (int fd : accepted_) close(fd);
    close(fd_);
  }
  LocalPort(const LocalPort&) = delete;
  LocalPort& operator=(const LocalPort&) = delete;

  std::string address(const std::string& host = "127.0.0.1") const { return host + ":" + std::to_string(port_); }

  // Whether a client connected since the last call (its connection is kept open, unanswered).
  bool take_connection() {
    const int fd = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return false;
    accepted_.push_back(fd);
    return true;
  }

 private:
  int fd_ = -1;
  int port_ = 0;
  std::vector<int> accepted_;
};

}  // namespace turnstile_test
