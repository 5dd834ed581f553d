// SPDX-License-Identifier: Apache-2.0
// The subcommands, as main() hands them their parsed options.
#pragma once

#include <chrono>
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
  std::optional<std::string> elect;         // `turnstile elect NAME`: campaign instead of a lock
  std::optional<std::string> leader_value;  // --value (default: HOST:PID)
  std::optional<std::int64_t> limit;
  std::vector<std::string> command;
  std::optional<std::string> shell;       // -c: run with /bin/sh -c (flock -c)
  std::optional<int> conflict_exit_code;  // the status when busy or timed out (flock -E)
  double connect_timeout_sec = 10;        // the most connecting may take (and never past --timeout)
  bool connect_timeout_given = false;     // else, with --timeout 0, connecting gets kTryOnceConnect
  std::string holder_label;               // consul lock's -name: shown by inspect
  bool verbose = false;                   // -v: what it waits for, who holds it, when it got it, its token
  bool quiet = false;                     // -q: nothing said when busy or timed out (flock -q); -v overrides
  std::optional<std::string> events;      // --events FILE ("-": stderr): every event as a JSON line
  // -o (flock -o): release when COMMAND exits, leaving what it started in its group running
  // without the hold, instead of stopping those processes first.
  bool release_at_command_exit = false;
  std::optional<std::string> hold_at_least;  // --hold-at-least DURATION, as given (run_options.hpp)
};
int run_command(const RunOptions& options);
// `turnstile hold`: the same options without a command; keeps the hold until told to let go.
int hold_command(const RunOptions& options);

// The hidden subcommand the group watcher executes after turnstile was killed without
// releasing (release_receipt.cpp): it removes the dead hold's entry on the server.
inline constexpr const char* kReleaseReceiptCommand = "__release-receipt";
// What it reads from stdin: the backend (as --backend gave it, or the default) and the receipt.
std::string release_order(const std::optional<std::string>& backend, const std::string& receipt);
inline constexpr std::size_t kMaxReleaseOrder = 16 * 1024;
// Its bounds: connecting, the release's tries, and the whole (SIGALRM) whatever hangs.
inline constexpr auto kReleaseByReceiptConnect = std::chrono::milliseconds(1000);
inline constexpr auto kReleaseByReceiptTries = std::chrono::milliseconds(1000);
inline constexpr unsigned kReleaseByReceiptGiveUp = 5;  // seconds
int release_receipt_command();

struct InspectOptions {
  std::optional<std::string> backend;
  bool json = false;
  bool watch = false;         // show it again whenever it changes, until interrupted
  double interval_sec = 0.5;  // between looks with --watch
  double connect_timeout_sec = 10;
  std::string name;                      // "": list the names in use instead
  std::optional<std::string> prefix;     // when listing: only names that start with it
  std::optional<std::size_t> max_names;  // when listing: at most this many names (default 100)
};
int inspect_command(const InspectOptions& options);

struct LeaderOptions {
  std::optional<std::string> backend;
  std::string name;
  bool json = false;
  bool watch = false;  // one line (object) per change until interrupted
  double connect_timeout_sec = 10;
};
// `turnstile leader NAME`: the election's leader value (exit 1 when nobody leads).
int leader_command(const LeaderOptions& options);

struct GcOptions {
  std::optional<std::string> backend;
  std::string prefix;    // only names starting with it ("" for all)
  bool quiet = false;    // -q: print nothing, only the exit status
  bool verbose = false;  // -v: also say on stderr how many names' state it removed, and where
};
// `turnstile gc`: removes what the backend keeps for names nobody uses; prints what it removed.
int gc_command(const GcOptions& options);

struct ParkingOptions {
  std::int64_t cars = 10;
  std::int64_t spaces = 3;
  std::optional<std::string> backend;
};
int parking_demo(const ParkingOptions& options);

}  // namespace turnstile::cli
