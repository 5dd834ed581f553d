// Helpers shared by the tests of the network backends (tests/redis, tests/zookeeper,
// tests/etcd): the server's URL from its fixture's file, shell commands for the peers' own
// tools (redis-cli, etcdctl, a Curator JVM), bounded waits, and unique names.
#pragma once

#include <array>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <thread>

#include <unistd.h>

#include <turnstile/turnstile.hpp>

namespace server_tests {

using namespace std::chrono_literals;

// The first line of a file ("" when missing): where a CTest fixture leaves its server's URL.
inline std::string read_first_line(const std::string& path) {
  std::ifstream file(path);
  std::string line;
  std::getline(file, line);
  return line;
}

// Runs a shell command; returns its output (stderr included) without the trailing newline.
inline std::string shell(const std::string& command) {
  std::string output;
  if (FILE* pipe = popen((command + " 2>&1").c_str(), "r")) {
    std::array<char, 4096> buffer;
    while (std::fgets(buffer.data(), buffer.size(), pipe)) output += buffer.data();
    pclose(pipe);
  }
  while (!output.empty() && (output.back() == '\n' || output.back() == '\r')) output.pop_back();
  return output;
}

// Single-quotes a string for the shell.
inline std::string quoted(const std::string& text) {
  std::string out = "'";
  for (char c : text) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Polls until `predicate` holds or `timeout` passes; returns its last value.
inline bool eventually(const std::function<bool()>& predicate, std::chrono::milliseconds timeout = 10s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (predicate()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return predicate();
}

// A name unique to this test run: tests sharing a fixture server never see each other's state.
inline std::string unique_name(const std::string& leaf) {
  return "test/" + std::to_string(getpid()) + "-" + std::to_string(std::random_device{}()) + "/" + leaf;
}

inline turnstile::ClientOptions with_ttl(std::chrono::milliseconds ttl) {
  turnstile::ClientOptions options;
  options.ttl = ttl;
  return options;
}

}  // namespace server_tests
