// SPDX-License-Identifier: Apache-2.0
// CuratorPeer.java (Curator's recipes from Debian's jars) in a JVM, for the interop tests.
#pragma once

#include <chrono>
#include <cstring>
#include <string>

#include "support/peer_process.hpp"
#include "support/server_tests.hpp"

namespace zookeeper_tests {

using namespace std::chrono_literals;

// The suite's server (its URL in TURNSTILE_ZOOKEEPER_URL_FILE), and its "host:port".
inline std::string server_url() { return server_tests::read_first_line(TURNSTILE_ZOOKEEPER_URL_FILE); }
inline std::string host_port() { return server_url().substr(std::strlen("zk://")); }

// CuratorPeer.java in a JVM, driven through its stdin and stdout.
class CuratorPeer : public turnstile_test::PeerProcess {
 public:
  explicit CuratorPeer(const std::string& connect)
      : PeerProcess({"java", "-Xshare:auto", "-XX:TieredStopAtLevel=1", "-cp", TURNSTILE_CURATOR_CLASSPATH,
                     "CuratorPeer", connect}) {}
  void send(const std::string& line) { tell(line); }
  // The next line the peer prints, or "" when none comes in time.
  std::string next_line(std::chrono::milliseconds timeout = 15s) { return line(timeout); }
};

}  // namespace zookeeper_tests

// Starts a peer named `curator` connected to host_port(), or skips the test without Java.
#define REQUIRE_CURATOR()                                                                      \
  if (std::string(TURNSTILE_CURATOR_CLASSPATH).empty()) GTEST_SKIP() << "no javac or Curator"; \
  CuratorPeer curator(host_port());                                                            \
  ASSERT_TRUE(curator.ready()) << "the Curator peer did not start"
