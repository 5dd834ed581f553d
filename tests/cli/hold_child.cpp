// SPDX-License-Identifier: Apache-2.0
// Run by `turnstile run` in the CLI tests: records the hold it runs under (token and name from
// the environment turnstile gives it) in a hold-history file.
// Usage: cli_hold_child HISTORY_FILE KIND PERMITS HOLD_MS
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "testing/hold_history.hpp"

int main(int argc, char** argv) {
  const char* token = std::getenv("TURNSTILE_FENCING_TOKEN");
  const char* name = std::getenv("TURNSTILE_NAME");
  if (argc != 5 || !token || !name) {
    std::fprintf(stderr, "usage: cli_hold_child HISTORY KIND PERMITS HOLD_MS, under turnstile run\n");
    return 2;
  }
  turnstile::testing::FileHoldRecorder recorder(argv[1]);
  turnstile::testing::HoldRecord record;
  record.name = name;
  record.kind = argv[2];
  record.permits = std::stoll(argv[3]);
  record.token = std::stoull(token);
  // Started after turnstile acquired and ends before it releases: inside the real hold.
  record.start_ns = turnstile::testing::monotonic_ns();
  std::this_thread::sleep_for(std::chrono::milliseconds(std::stoi(argv[4])));
  record.end_ns = turnstile::testing::monotonic_ns();
  recorder.record(record);
  return 0;
}
