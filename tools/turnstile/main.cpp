// turnstile: run a command under a distributed lock or semaphore, keep a hold for a shell
// script, inspect a queue, or watch the parking-lot demo. Parsing only; each subcommand lives in
// its own file.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <turnstile/turnstile.hpp>

#include "commands.hpp"
#include "common.hpp"

using namespace turnstile::cli;

namespace {

// Copies an option's value into an optional only when it was given on the command line.
template <class T>
void take_if_given(const CLI::Option* option, const T& value, std::optional<T>& target) {
  if (option->count() > 0) target = value;
}

// The options `run` and `hold` share: where, what, how long, and how to say it. CLI11 fills the
// plain values; apply() copies those given into RunOptions.
struct AcquireFlags {
  std::string backend, lock, read, write, semaphore, label;
  double timeout = 0, ttl = 0;
  std::int64_t limit = 0;
  int conflict = 0;
  CLI::Option *backend_opt{}, *timeout_opt{}, *ttl_opt{}, *lock_opt{}, *read_opt{}, *write_opt{}, *semaphore_opt{},
      *limit_opt{}, *conflict_opt{}, *label_opt{}, *connect_timeout_opt{};

  void add_to(CLI::App* cmd, RunOptions& run) {
    backend_opt =
        cmd->add_option("--backend", backend, "Backend URL (default: $TURNSTILE_BACKEND, else the embedded default)");
    timeout_opt = cmd->add_option(
        "--timeout", timeout,
        "Seconds to wait for the hold, connecting included (fractional; 0 tries once; default: forever)");
    connect_timeout_opt = cmd->add_option("--connect-timeout", run.connect_timeout_sec,
                                          "Seconds connecting to the backend may take (never more than a positive "
                                          "--timeout; with --timeout 0, 1 s unless given)")
                              ->capture_default_str();
    ttl_opt = cmd->add_option("--ttl", ttl, "Hold time-to-live in seconds, on backends that expire holds");
    lock_opt = cmd->add_option("--lock", lock, "Hold the Mutex NAME");
    read_opt = cmd->add_option("--read", read, "Hold the read side of the SharedMutex NAME");
    write_opt = cmd->add_option("--write", write, "Hold the write side of the SharedMutex NAME");
    semaphore_opt = cmd->add_option("--semaphore", semaphore, "Hold one lease of the Semaphore NAME (needs --limit)");
    limit_opt = cmd->add_option("--limit", limit, "The Semaphore's limit");
    conflict_opt = cmd->add_option("-E,--conflict-exit-code", conflict,
                                   "Exit status when the name is busy or --timeout ran out (default 75; flock -E)");
    label_opt = cmd->add_option(
        "--holder-label", label,
        "A label for this hold (consul lock -name), shown by inspect and in busy messages on backends that keep it");
    cmd->add_flag("-v,--verbose", run.verbose,
                  "Say on stderr what it waits for, who holds it, when it got it and its fencing token");
  }

  void apply(RunOptions& run) const {
    take_if_given(backend_opt, backend, run.backend);
    take_if_given(timeout_opt, timeout, run.timeout_sec);
    take_if_given(ttl_opt, ttl, run.ttl_sec);
    take_if_given(lock_opt, lock, run.lock);
    take_if_given(read_opt, read, run.read);
    take_if_given(write_opt, write, run.write);
    take_if_given(semaphore_opt, semaphore, run.semaphore);
    take_if_given(limit_opt, limit, run.limit);
    if (conflict_opt->count() > 0) run.conflict_exit_code = conflict;
    if (label_opt->count() > 0) run.holder_label = label;
    run.connect_timeout_given = connect_timeout_opt->count() > 0;
  }
};

constexpr const char* kExitStatuses =
    "  64  usage error, bad name or URL          69  the backend cannot be reached\n"
    "  70  the hold was lost                     71  an operating-system call failed\n"
    "  75  busy: --timeout ran out, or 0 and held (or --conflict-exit-code)\n"
    "  77  permission denied (ACL, credentials, the state directory)\n";

// Everything after the first "--" of `run ... -- COMMAND ARGS` belongs to the command: cut off
// before CLI11 sees it (it would otherwise parse the command's own options).
std::vector<std::string> split_off_command(std::vector<std::string>& args) {
  std::vector<std::string> command;
  if (!args.empty() && args.front() == "run") {
    if (auto dashes = std::find(args.begin() + 1, args.end(), "--"); dashes != args.end()) {
      command.assign(dashes + 1, args.end());
      args.erase(dashes, args.end());
    }
  }
  return command;
}

// The subcommands: the values CLI11 fills for each, and the options whose presence counts. It
// keeps the addresses CLI11 writes to, so it stays where it was made.
struct Subcommands {
  RunOptions run;
  AcquireFlags run_flags;
  std::string shell_value;
  CLI::App* run_cmd{};
  CLI::Option* run_shell{};

  RunOptions hold;
  AcquireFlags hold_flags;
  std::string hold_name;
  CLI::App* hold_cmd{};
  CLI::Option* hold_name_opt{};

  InspectOptions inspect;
  std::string inspect_backend;
  CLI::App* inspect_cmd{};
  CLI::Option* inspect_backend_opt{};

  ParkingOptions parking;
  std::string parking_backend;
  CLI::App* parking_cmd{};
  CLI::Option* parking_backend_opt{};

  Subcommands(const Subcommands&) = delete;
  Subcommands& operator=(const Subcommands&) = delete;
  Subcommands() = default;

  void add_to(CLI::App& app) {
    add_run(app);
    add_hold(app);
    add_inspect(app);
    add_demo(app);
  }

  void add_run(CLI::App& app) {
    run_cmd = app.add_subcommand("run", "Hold a lock or semaphore while COMMAND runs (put COMMAND after --).");
    run_flags.add_to(run_cmd, run);
    run_cmd
        ->add_option("--grace", run.grace_sec,
                     "Seconds between SIGTERM and SIGKILL when the hold is lost (then at most TTL/20, or 0.5 s without "
                     "a known TTL) or the command leaves processes behind")
        ->capture_default_str();
    run_cmd->add_flag("--pause-when-suspended", run.pause_when_suspended,
                      "Stop the command's process group (SIGSTOP) while the backend cannot confirm the hold; continue "
                      "it (SIGCONT) once confirmed");
    run_shell = run_cmd->add_option("-c,--shell", shell_value,
                                    "Run COMMAND-LINE with /bin/sh -c instead of a COMMAND after -- (flock -c)");
    // This CLI11 has no usage(): the description carries the full synopsis.
    run_cmd->description(
        "Hold a lock or semaphore while COMMAND runs.\n"
        "  turnstile run [OPTIONS] (--lock|--read|--write|--semaphore) NAME -- COMMAND [ARGS...]\n"
        "  turnstile run [OPTIONS] (--lock|--read|--write|--semaphore) NAME -c 'COMMAND LINE'");
    run_cmd->footer(
        "COMMAND runs with TURNSTILE_NAME (the name held) and TURNSTILE_FENCING_TOKEN (this hold's token,\n"
        "strictly greater than any earlier holder's) in its environment, in a process group of its own.\n\n"
        "Exit status: COMMAND's own status (128+N when killed by signal N), else\n" +
        std::string(kExitStatuses) +
        "  126 COMMAND cannot be executed            127 COMMAND not found\n"
        "  128+N  a signal N arrived before COMMAND started (it was not run)\n\n"
        "Example: turnstile run --lock jobs/nightly --timeout 10 -- ./nightly.sh");
  }

  void add_hold(CLI::App& app) {
    hold_cmd = app.add_subcommand(
        "hold", "Take a hold and keep it, printing its fencing token, until stdin closes or a signal comes.");
    hold_flags.add_to(hold_cmd, hold);
    hold_name_opt = hold_cmd->add_option("NAME", hold_name, "The Mutex to hold (the same as --lock NAME)");
    hold_cmd->description(
        "Take a hold and keep it without running a command (as etcdctl lock NAME): its fencing token\n"
        "is printed on stdout once it is held, and it is kept until stdin (a pipe) closes, the reader of\n"
        "stdout (a pipe) goes away, or SIGTERM, SIGINT or SIGHUP arrives; then it is released.\n"
        "  turnstile hold [OPTIONS] NAME\n"
        "  turnstile hold [OPTIONS] (--lock|--read|--write|--semaphore) NAME");
    hold_cmd->footer(
        "A terminal, /dev/null or a file on stdin is not read: then only a signal or the reader of stdout\n"
        "ends the hold. In a shell script:\n"
        "  coproc HOLD { turnstile hold jobs/nightly; }\n"
        "  hold_pid=$HOLD_PID                           # now: bash unsets HOLD_PID when HOLD ends\n"
        "  read -r token <&\"${HOLD[0]}\" || exit 75     # nothing printed: not held\n"
        "  ...                                          # the region; $token fences its writes\n"
        "  exec {HOLD[1]}>&-; wait \"$hold_pid\"          # released; 0 if it was kept throughout\n\n"
        "Exit status: 0 released as asked (stdin closed, reader gone or a signal), else\n" +
        std::string(kExitStatuses) + "  128+N  a signal N arrived before it was held (nothing was printed)");
  }

  void add_inspect(CLI::App& app) {
    inspect_cmd = app.add_subcommand("inspect", "Show the holders and waiters of NAME, in queue order.");
    inspect_backend_opt = inspect_cmd->add_option(
        "--backend", inspect_backend, "Backend URL (default: $TURNSTILE_BACKEND, else the embedded default)");
    inspect_cmd->add_flag("--json", inspect.json, "Print one JSON object (schema: docs/inspect-json.md)");
    inspect_cmd->add_flag(
        "--watch", inspect.watch,
        "Show it again each time the holders or waiters change, until interrupted (with --json: one object per line)");
    inspect_cmd->add_option("--interval", inspect.interval_sec, "Seconds between looks with --watch")
        ->capture_default_str();
    inspect_cmd
        ->add_option("--connect-timeout", inspect.connect_timeout_sec, "Seconds connecting to the backend may take")
        ->capture_default_str();
    inspect_cmd->add_option("NAME", inspect.name, "The lock or semaphore name")->required();
    inspect_cmd->footer(
        "The first line names the backend read (URL with credentials redacted). A file:// directory that\n"
        "does not exist is not created: nobody is queued there.");
  }

  void add_demo(CLI::App& app) {
    auto* demo_cmd = app.add_subcommand("demo", "Demonstrations.");
    demo_cmd->require_subcommand(1);
    parking_cmd = demo_cmd->add_subcommand("parking", "Cars (processes) share a parking lot (a Semaphore).");
    parking_cmd->add_option("--cars", parking.cars, "Number of cars, 1 to 1000")->capture_default_str();
    parking_cmd->add_option("--spaces", parking.spaces, "Number of spaces, 1 to 1000")->capture_default_str();
    parking_backend_opt =
        parking_cmd->add_option("--backend", parking_backend, "Backend URL (default: a fresh private directory)");
  }

  // Runs the subcommand parsed; `command` is what followed "--".
  int dispatch(std::vector<std::string> command) {
    if (run_cmd->parsed()) {
      run_flags.apply(run);
      take_if_given(run_shell, shell_value, run.shell);
      run.command = std::move(command);
      return run_command(run);
    }
    if (hold_cmd->parsed()) return dispatch_hold();
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

  int dispatch_hold() {
    hold_flags.apply(hold);
    if (hold_name_opt->count() > 0) {
      if (hold.lock || hold.read || hold.write || hold.semaphore) {
        complain("give NAME or one of --lock, --read, --write, --semaphore, not both");
        return kExitUsage;
      }
      hold.lock = hold_name;
    }
    return hold_command(hold);
  }
};

// Says what is wrong with the command line (or prints --help); the exit status.
int parse_failure(const CLI::App& app, const CLI::ParseError& error, const std::vector<std::string>& args,
                  bool command_missing) {
  if (error.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(error);  // --help
  const std::vector<std::string> subcommands{"run", "hold", "inspect", "demo"};
  const bool unknown_subcommand = !args.empty() && !args.front().starts_with('-') &&
                                  std::find(subcommands.begin(), subcommands.end(), args.front()) == subcommands.end();
  complain(unknown_subcommand
               ? "unknown subcommand '" + printable(args.front()) + "' (expected run, hold, inspect or demo)"
               : std::string(error.what()));
  if (command_missing) complain("put the command to run after '--'");
  std::fprintf(stderr, "Run with --help for more information.\n");
  return kExitUsage;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  std::vector<std::string> command = split_off_command(args);

  CLI::App app{
      "Run commands under distributed locks and semaphores, keep a hold for a shell script, and inspect "
      "their queues.",
      "turnstile"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("turnstile ") + turnstile::version());
  Subcommands subcommands;
  subcommands.add_to(app);

  std::vector<char*> parse_argv{argv[0]};
  for (auto& arg : args) parse_argv.push_back(arg.data());
  try {
    app.parse(static_cast<int>(parse_argv.size()), parse_argv.data());
  } catch (const CLI::ParseError& error) {
    const bool command_missing =
        subcommands.run_cmd->parsed() && command.empty() && subcommands.run_shell->count() == 0;
    return parse_failure(app, error, args, command_missing);
  }
  return subcommands.dispatch(std::move(command));
}
