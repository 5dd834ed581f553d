// turnstile: run a command under a distributed lock or semaphore, inspect a queue, or watch
// the parking-lot demo. Parsing only; each subcommand lives in its own file.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "commands.hpp"
#include "common.hpp"

using namespace turnstile::cli;

namespace {

// Copies an option's value into an optional only when it was given on the command line.
template <class T>
void take_if_given(const CLI::Option* option, const T& value, std::optional<T>& target) {
  if (option->count() > 0) target = value;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  // `run ... -- COMMAND ARGS`: everything after the first "--" belongs to the command, so we
  // cut it off before CLI11 sees it (it would otherwise parse the command's own options).
  std::vector<std::string> command;
  if (!args.empty() && args.front() == "run") {
    if (auto dashes = std::find(args.begin() + 1, args.end(), "--"); dashes != args.end()) {
      command.assign(dashes + 1, args.end());
      args.erase(dashes, args.end());
    }
  }

  CLI::App app{"Run commands under distributed locks and semaphores, and inspect their queues.",
               "turnstile"};
  app.require_subcommand(1);

  RunOptions run;
  std::string backend_value, lock_value, read_value, write_value, semaphore_value;
  double timeout_value = 0, ttl_value = 0;
  std::int64_t limit_value = 0;
  auto* run_cmd = app.add_subcommand("run", "Hold a lock or semaphore while COMMAND runs (put COMMAND after --).");
  auto* run_backend = run_cmd->add_option("--backend", backend_value, "Backend URL (default: $TURNSTILE_BACKEND, else the embedded default)");
  auto* run_timeout = run_cmd->add_option("--timeout", timeout_value, "Seconds to wait for the hold (fractional; 0 tries once; default: forever)");
  auto* run_ttl = run_cmd->add_option("--ttl", ttl_value, "Hold time-to-live in seconds, on backends that expire holds");
  run_cmd->add_option("--grace", run.grace_sec, "Seconds between SIGTERM and SIGKILL when the hold is lost (then at most TTL/20, or 0.5 s without a known TTL) or the command leaves processes behind")->capture_default_str();
  run_cmd->add_flag("--pause-when-suspended", run.pause_when_suspended,
                    "Stop the command's process group (SIGSTOP) while the backend cannot confirm the hold; continue it (SIGCONT) once confirmed");
  auto* run_lock = run_cmd->add_option("--lock", lock_value, "Hold the Mutex NAME");
  auto* run_read = run_cmd->add_option("--read", read_value, "Hold the read side of the SharedMutex NAME");
  auto* run_write = run_cmd->add_option("--write", write_value, "Hold the write side of the SharedMutex NAME");
  auto* run_semaphore = run_cmd->add_option("--semaphore", semaphore_value, "Hold one lease of the Semaphore NAME (needs --limit)");
  auto* run_limit = run_cmd->add_option("--limit", limit_value, "The Semaphore's limit");
  run_cmd->footer("Example: turnstile run --lock jobs/nightly --timeout 10 -- ./nightly.sh");

  turnstile::cli::InspectOptions inspect;
  std::string inspect_backend;
  auto* inspect_cmd = app.add_subcommand("inspect", "Show the holders and waiters of NAME, in queue order.");
  auto* inspect_backend_opt = inspect_cmd->add_option("--backend", inspect_backend, "Backend URL");
  inspect_cmd->add_flag("--json", inspect.json, "Print one JSON object");
  inspect_cmd->add_option("NAME", inspect.name, "The lock or semaphore name")->required();

  auto* demo_cmd = app.add_subcommand("demo", "Demonstrations.");
  demo_cmd->require_subcommand(1);
  ParkingOptions parking;
  std::string parking_backend;
  auto* parking_cmd = demo_cmd->add_subcommand("parking", "Cars (processes) share a parking lot (a Semaphore).");
  parking_cmd->add_option("--cars", parking.cars, "Number of cars, 1 to 1000")->capture_default_str();
  parking_cmd->add_option("--spaces", parking.spaces, "Number of spaces, 1 to 1000")->capture_default_str();
  auto* parking_backend_opt = parking_cmd->add_option("--backend", parking_backend, "Backend URL (default: a fresh private directory)");

  std::vector<char*> parse_argv{argv[0]};
  for (auto& arg : args) parse_argv.push_back(arg.data());
  try {
    app.parse(static_cast<int>(parse_argv.size()), parse_argv.data());
  } catch (const CLI::ParseError& error) {
    if (error.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(error);  // --help
    const bool unknown_subcommand = !args.empty() && !args.front().starts_with('-') && args.front() != "run" &&
                                    args.front() != "inspect" && args.front() != "demo";
    complain(unknown_subcommand ? "unknown subcommand '" + args.front() + "' (expected run, inspect or demo)"
                                : std::string(error.what()));
    if (run_cmd->parsed() && command.empty()) complain("put the command to run after '--'");
    std::fprintf(stderr, "Run with --help for more information.\n");
    return kExitUsage;
  }

  if (run_cmd->parsed()) {
    take_if_given(run_backend, backend_value, run.backend);
    take_if_given(run_timeout, timeout_value, run.timeout_sec);
    take_if_given(run_ttl, ttl_value, run.ttl_sec);
    take_if_given(run_lock, lock_value, run.lock);
    take_if_given(run_read, read_value, run.read);
    take_if_given(run_write, write_value, run.write);
    take_if_given(run_semaphore, semaphore_value, run.semaphore);
    take_if_given(run_limit, limit_value, run.limit);
    run.command = std::move(command);
    return run_command(run);
  }
  if (inspect_cmd->parsed()) {
    take_if_given(inspect_backend_opt, inspect_backend, inspect.backend);
    return inspect_command(inspect);
  }
  if (parking_cmd->parsed()) {
    take_if_given(parking_backend_opt, parking_backend, parking.backend);
    return parking_demo(parking);
  }
  return kExitUsage;  // unreachable: a subcommand is required
}
