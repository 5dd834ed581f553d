// The subcommands, as main() hands them their parsed options.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace turnstile::cli {

struct RunOptions {
  std::optional<std::string> backend;
  std::optional<double> timeout_sec;  // unset: wait forever; 0: try once
  std::optional<double> ttl_sec;
  double grace_sec = 5;
  bool pause_when_suspended = false;  // SIGSTOP the command while the hold is suspended
  std::optional<std::string> lock, read, write, semaphore;
  std::optional<std::int64_t> limit;
  std::vector<std::string> command;
};
int run_command(const RunOptions& options);

struct InspectOptions {
  std::optional<std::string> backend;
  bool json = false;
  std::string name;
};
int inspect_command(const InspectOptions& options);

struct ParkingOptions {
  std::int64_t cars = 10;
  std::int64_t spaces = 3;
  std::optional<std::string> backend;
};
int parking_demo(const ParkingOptions& options);

}  // namespace turnstile::cli
