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
  std::optional<std::string> shell;       // -c: run with /bin/sh -c (flock -c)
  std::optional<int> conflict_exit_code;  // the status when busy or timed out (flock -E)
  double connect_timeout_sec = 10;        // the most connecting may take (and never past --timeout)
  bool connect_timeout_given = false;     // else, with --timeout 0, connecting gets kTryOnceConnect
  std::string holder_label;               // consul lock's -name: shown by inspect
  bool verbose = false;                   // -v: what it waits for, who holds it, when it got it, its token
};
int run_command(const RunOptions& options);
// `turnstile hold`: the same options without a command; keeps the hold until told to let go.
int hold_command(const RunOptions& options);

struct InspectOptions {
  std::optional<std::string> backend;
  bool json = false;
  bool watch = false;         // show it again whenever it changes, until interrupted
  double interval_sec = 0.5;  // between looks with --watch
  double connect_timeout_sec = 10;
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
