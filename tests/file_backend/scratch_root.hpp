// SPDX-License-Identifier: Apache-2.0
// A test fixture of the file_backend tests: a fresh scratch directory per test, whose "root"
// (made by the first client) is the backend directory of url_, removed with everything in it.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>

namespace file_backend_test {

class ScratchRoot : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/turnstile-file-test-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    scratch_ = dir;
    url_ = "file://" + scratch_ + "/root";
  }
  void TearDown() override {
    std::error_code ignored;
    std::filesystem::remove_all(scratch_, ignored);
  }
  // The state file of a name made only of letters, digits and "-_." (kept as is).
  std::string state_of(const std::string& name) const { return scratch_ + "/root/n." + name + ".s"; }

  static bool eventually(const std::function<bool()>& predicate, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!predicate()) {
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return true;
  }

  std::string scratch_;
  std::string url_;
};

}  // namespace file_backend_test
