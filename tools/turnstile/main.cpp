// SPDX-License-Identifier: Apache-2.0
// turnstile: run a command under a distributed lock or semaphore, keep a hold for a shell
// script, inspect a queue, or watch the parking-lot demo. Parsing only; each subcommand lives in
// its own file.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include <turnstile/turnstile.hpp>

#include "command_group.hpp"
#include "commands.hpp"
#include "common.hpp"
#include "core/url.hpp"
#include "run_options.hpp"
#include "serve.hpp"

using namespace turnstile::cli;

namespace {

// `text` as a whole number, or nullopt (not a number, or out of the type's range).
std::optional<std::int64_t> whole_number(const std::string& text) {
  std::int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

// Copies an option's value into an optional only when it was given on the command line.
template <class T>
void take_if_given(const CLI::Option* option, const T& value, std::optional<T>& target) {
  if (option->count() > 0) target = value;
}

// The options `run` and `hold` share: where, what, how long, and how to say it. CLI11 fills the
// plain values; apply() copies those given into RunOptions.
struct AcquireFlags {
  std::string backend, lock, read, write, semaphore, label, name;
  double timeout = 0, ttl = 0, wait = 0;
  std::string limit;  // parsed here: CLI11 clamps an out-of-range number to the type's maximum
  int conflict = 0;
  FlockForms flock;
  std::string hold_at_least;
  CLI::Option* hold_at_least_opt{};
  CLI::Option *backend_opt{}, *timeout_opt{}, *ttl_opt{}, *lock_opt{}, *read_opt{}, *write_opt{}, *semaphore_opt{},
      *limit_opt{}, *conflict_opt{}, *label_opt{}, *connect_timeout_opt{}, *name_opt{}, *wait_opt{};

  void add_to(CLI::App* cmd, RunOptions& run) {
    add_common_to(cmd, run);
    lock_opt = cmd->add_option("--lock", lock, "Hold the Mutex NAME");
    read_opt = cmd->add_option("--read", read, "Hold the read side of the SharedMutex NAME");
    write_opt = cmd->add_option("--write", write, "Hold the write side of the SharedMutex NAME");
    semaphore_opt = cmd->add_option("--semaphore", semaphore, "Hold one lease of the Semaphore NAME (needs --limit)");
    limit_opt = cmd->add_option("--limit", limit, "The Semaphore's limit");
    hold_at_least_opt = cmd->add_option("--hold-at-least", hold_at_least,
                                        "Keep the name held until DURATION (e.g. 30s, 5m; plain: seconds) after the "
                                        "command started (hold: after it was taken), even when it ends sooner");
    add_flock_forms_to(cmd);
  }

  // What every hold's command line has (`elect` has only these): where, how long, how to say it.
  void add_common_to(CLI::App* cmd, RunOptions& run) {
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
    conflict_opt = cmd->add_option("-E,--conflict-exit-code", conflict,
                                   "Exit status when the name is busy or --timeout ran out (default 75; flock -E)");
    label_opt = cmd->add_option(
        "--holder-label", label,
        "A label for this hold (consul lock -name), shown by inspect and in busy messages on backends that keep it");
    cmd->add_flag("-v,--verbose", run.verbose,
                  "Say on stderr what it waits for, who holds it, when it got it and its fencing token");
    cmd->add_option("--events", run.events,
                    "Write each acquire, hold, renewal and connection event as a JSON line to FILE "
                    "(appended; - for stderr)");
    cmd->add_flag("-q,--quiet", run.quiet,
                  "Say nothing when the name is busy or --timeout ran out, only exit 75 or -E's status "
                  "(flock -q; -v says it still)");
  }

  // What a flock(1) user types, with flock's meanings.
  void add_flock_forms_to(CLI::App* cmd) {
    cmd->add_flag("-n,--nonblock", flock.nonblock, "The same as --timeout 0: one try (flock -n)");
    wait_opt = cmd->add_option("-w,--wait", wait, "The same as --timeout SECONDS (flock -w)");
    cmd->add_flag("-s,--shared", flock.shared,
                  "With a bare NAME: hold the read side of the SharedMutex NAME (flock -s)");
    cmd->add_flag(
        "-x,-e,--exclusive", flock.exclusive,
        "With a bare NAME: hold the write side of the SharedMutex NAME, which excludes -s holders (flock -x)");
    name_opt = cmd->add_option("NAME", name,
                               "The name to hold: the Mutex NAME (the same as --lock NAME); with -s or -x a side of "
                               "the SharedMutex NAME");
  }

  void apply(RunOptions& run) const {
    apply_common(run);
    take_if_given(lock_opt, lock, run.lock);
    take_if_given(read_opt, read, run.read);
    take_if_given(write_opt, write, run.write);
    take_if_given(semaphore_opt, semaphore, run.semaphore);
    take_if_given(hold_at_least_opt, hold_at_least, run.hold_at_least);
  }

  void apply_common(RunOptions& run) const {
    take_if_given(backend_opt, backend, run.backend);
    take_if_given(timeout_opt, timeout, run.timeout_sec);
    take_if_given(ttl_opt, ttl, run.ttl_sec);
    if (conflict_opt->count() > 0) run.conflict_exit_code = conflict;
    if (label_opt->count() > 0) run.holder_label = label;
    run.connect_timeout_given = connect_timeout_opt->count() > 0;
  }

  // apply(), then the flock forms: the usage problem, or "".
  std::string apply_with_flock_forms(RunOptions& run) {
    apply(run);
    take_if_given(name_opt, name, flock.name);
    take_if_given(wait_opt, wait, flock.wait_sec);
    if (limit_opt->count() > 0) {
      run.limit = whole_number(limit);
      if (!run.limit) {
        return "--limit must be a whole number from 1 to " + std::to_string(turnstile::max_permits) + ", got '" +
               printable(limit) + "'";
      }
    }
    return adopt_flock_forms(flock, run);
  }
};

constexpr const char* kExitStatuses =
    "  64  usage error, bad name or URL          69  the backend cannot be reached\n"
    "  70  the hold was lost                     71  an operating-system call failed\n"
    "  73  --events FILE cannot be opened\n"
    "  75  busy: --timeout ran out, or 0 and held (or --conflict-exit-code)\n"
    "  77  permission denied (ACL, credentials, the state directory)\n";

// Everything after the first "--" of `run ... -- COMMAND ARGS` belongs to the command: cut off
// before CLI11 sees it (it would otherwise parse the command's own options).
std::vector<std::string> split_off_command(std::vector<std::string>& args) {
  std::vector<std::string> command;
  if (!args.empty() && (args.front() == "run" || args.front() == "elect")) {
    if (auto dashes = std::find(args.begin() + 1, args.end(), "--"); dashes != args.end()) {
      command.assign(dashes + 1, args.end());
      args.erase(dashes, args.end());
    }
  }
  return command;
}

// Hides the credentials of backend URLs in turnstile's own arguments as /proc/PID/cmdline and
// ps show them to every user of the host: a URL given with --backend (redis://:PASSWORD@…,
// consul://TOKEN@…) is rewritten in place, in the argument memory the kernel reads, once its
// value was copied for parsing. The watcher, a fork of turnstile, shows what turnstile shows.
// (mysql and curl do the same; TURNSTILE_BACKEND, which only the user can read in
// /proc/PID/environ, keeps them out of sight from the start.) The command's own arguments, after
// the first "--", are left as they are: they are its business.
void hide_credentials_in_arguments(int argc, char** argv) {
  for (int i = 1; i < argc && std::string_view(argv[i]) != "--"; ++i) {
    std::string_view arg = argv[i];
    const auto value_at = arg.starts_with("--backend=") ? std::string_view("--backend=").size() : 0;
    const auto url = arg.substr(value_at);
    if (url.find("://") == std::string_view::npos) continue;
    const auto redacted = turnstile::detail::redact_url(url);
    if (redacted == url) continue;
    char* out = argv[i] + value_at;
    if (redacted.size() <= url.size()) {
      std::copy(redacted.begin(), redacted.end(), out);
      std::fill(out + redacted.size(), out + url.size(), '\0');
    } else {  // a one- or two-byte secret: "***" would not fit; hide all after the scheme
      std::fill(out + url.find("://") + 3, out + url.size(), '*');
    }
  }
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
  CLI::App* hold_cmd{};

  RunOptions elect;
  AcquireFlags elect_flags;
  std::string elect_name, elect_value, elect_shell;
  bool elect_nonblock = false;
  CLI::App* elect_cmd{};
  CLI::Option *elect_shell_opt{}, *elect_value_opt{};

  LeaderOptions leader;
  std::string leader_backend;
  CLI::App* leader_cmd{};
  CLI::Option* leader_backend_opt{};

  InspectOptions inspect;
  std::string inspect_backend;
  CLI::App* inspect_cmd{};
  CLI::Option* inspect_backend_opt{};

  GcOptions gc;
  CLI::App* gc_cmd{};
  CLI::Option* gc_backend_opt{};
  std::string gc_backend;

  ServeOptions serve;
  std::string serve_backend;
  CLI::App* serve_cmd{};
  CLI::Option* serve_backend_opt{};

  ParkingOptions parking;
  std::string parking_backend;
  CLI::App* parking_cmd{};
  CLI::Option* parking_backend_opt{};

  Subcommands(const Subcommands&) = delete;
  Subcommands& operator=(const Subcommands&) = delete;
  Subcommands() = default;

  // `only`: the one subcommand whose options are made ("" for all); the others are there by name
  // and summary only (see main()).
  void add_to(CLI::App& app, const std::string& only) {
    only_ = only;
    add_run(app);
    add_hold(app);
    add_elect(app);
    add_leader(app);
    add_inspect(app);
    add_gc(app);
    add_serve(app);
    add_demo(app);
  }

  void add_run(CLI::App& app) {
    run_cmd = app.add_subcommand("run", "Hold a lock or semaphore while COMMAND runs (put COMMAND after --).");
    if (!builds(run_cmd)) return;
    run_flags.add_to(run_cmd, run);
    run_shell = add_command_options(run_cmd, run, shell_value);
    // This CLI11 has no usage(): the description carries the full synopsis.
    run_cmd->description(
        "Hold a lock or semaphore while COMMAND runs.\n"
        "  turnstile run [OPTIONS] (--lock|--read|--write|--semaphore) NAME -- COMMAND [ARGS...]\n"
        "  turnstile run [OPTIONS] (--lock|--read|--write|--semaphore) NAME -c 'COMMAND LINE'\n"
        "  turnstile run [OPTIONS] [-s|-x] NAME (-- COMMAND [ARGS...] | -c 'COMMAND LINE')");
    run_cmd->footer(
        "COMMAND runs with TURNSTILE_NAME (the name held) and TURNSTILE_FENCING_TOKEN (this hold's token,\n"
        "strictly greater than any earlier holder's) in its environment, in a process group of its own.\n\n"
        "Exit status: COMMAND's own status (128+N when killed by signal N), else\n" +
        std::string(kExitStatuses) +
        "  126 COMMAND cannot be executed            127 COMMAND not found\n"
        "  128+N  a signal N arrived before COMMAND started (it was not run)\n\n"
        "Example: turnstile run --lock jobs/nightly --timeout 10 -- ./nightly.sh");
  }

  // What `run` and `elect` do with the command: its grace, pauses, -c and -o.
  static CLI::Option* add_command_options(CLI::App* cmd, RunOptions& options, std::string& shell) {
    cmd->add_option("--grace", options.grace_sec,
                    "Seconds between SIGTERM and SIGKILL when the hold is lost (then at most TTL/20, or 0.5 s without "
                    "a known TTL) or the command leaves processes behind")
        ->capture_default_str();
    cmd->add_flag("--pause-when-suspended", options.pause_when_suspended,
                  "Stop the command's process group (SIGSTOP) while the backend cannot confirm the hold; continue "
                  "it (SIGCONT) once confirmed");
    auto* shell_opt = cmd->add_option("-c,--shell", shell,
                                      "Run COMMAND-LINE with /bin/sh -c instead of a COMMAND after -- (flock -c)");
    cmd->add_flag("-o,--close", options.release_at_command_exit,
                  "Release when COMMAND exits and leave the processes it started in its group running without "
                  "the hold, instead of stopping them first (flock -o)");
    return shell_opt;
  }

  void add_elect(CLI::App& app) {
    elect_cmd = app.add_subcommand("elect", "Campaign for leadership of NAME; run COMMAND while leader.");
    if (!builds(elect_cmd)) return;
    elect_flags.add_common_to(elect_cmd, elect);
    elect_shell_opt = add_command_options(elect_cmd, elect, elect_shell);
    elect_cmd->add_flag("-n,--nonblock", elect_nonblock, "The same as --timeout 0: one try (as run -n, flock -n)");
    elect_value_opt = elect_cmd->add_option(
        "--value", elect_value, "The leader's value, what `turnstile leader NAME` prints (default: HOST:PID)");
    elect_cmd->add_option("NAME", elect_name, "The election's name")->required();
    elect_cmd->description(
        "Campaign for leadership of the election NAME (candidates lead in arrival order) and run COMMAND\n"
        "while leader, as `run` does with a lock: leadership lost stops COMMAND's group.\n"
        "  turnstile elect [OPTIONS] NAME [--value V] -- COMMAND [ARGS...]\n"
        "  turnstile elect [OPTIONS] NAME [--value V] -c 'COMMAND LINE'");
    elect_cmd->footer(
        "COMMAND runs with TURNSTILE_NAME, TURNSTILE_FENCING_TOKEN (the leadership's token) and\n"
        "TURNSTILE_LEADER_VALUE in its environment. When COMMAND ends, the leader resigns.\n\n"
        "Exit status: COMMAND's own status (128+N when killed by signal N), else\n" +
        std::string(kExitStatuses) + "  126 COMMAND cannot be executed            127 COMMAND not found");
  }

  void add_leader(CLI::App& app) {
    leader_cmd = app.add_subcommand("leader", "Print the leader value of the election NAME.");
    if (!builds(leader_cmd)) return;
    leader_backend_opt = leader_cmd->add_option("--backend", leader_backend,
                                                "Backend URL (default: $TURNSTILE_BACKEND, else the embedded default)");
    leader_cmd->add_flag("--json", leader.json,
                         "Print {\"name\",\"leader\",\"value\",\"fencing_token\",\"since\"} (since: ISO-8601 UTC, ms; "
                         "null when unknown)");
    leader_cmd->add_flag("--watch", leader.watch, "Print the leader again on each change, until interrupted");
    leader_cmd
        ->add_option("--connect-timeout", leader.connect_timeout_sec, "Seconds connecting to the backend may take")
        ->capture_default_str();
    leader_cmd->add_option("NAME", leader.name, "The election's name")->required();
    leader_cmd->footer(
        "Exit status: 0 a leader was printed, 1 nobody leads (without --watch), 64, 69 and 77 as run's.");
  }

  void add_hold(CLI::App& app) {
    hold_cmd = app.add_subcommand(
        "hold", "Take a hold and keep it, printing its fencing token, until stdin closes or a signal comes.");
    if (!builds(hold_cmd)) return;
    hold_flags.add_to(hold_cmd, hold);
    hold_cmd->description(
        "Take a hold and keep it without running a command (as etcdctl lock NAME): its fencing token\n"
        "is printed on stdout once it is held, and it is kept until stdin (a pipe) closes, the reader of\n"
        "stdout (a pipe) goes away, or SIGTERM, SIGINT or SIGHUP arrives; then it is released.\n"
        "  turnstile hold [OPTIONS] NAME\n"
        "  turnstile hold [OPTIONS] (-s|-x) NAME\n"
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
    inspect_cmd = app.add_subcommand(
        "inspect", "Show the holders and waiters of NAME, in queue order; without NAME, list the names in use.");
    if (!builds(inspect_cmd)) return;
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
    inspect_cmd->add_option("--prefix", inspect.prefix, "Without NAME: list only the names that start with PREFIX");
    inspect_cmd->add_option("--max-names", inspect.max_names,
                            "Without NAME: list at most this many names, 1 to 10000 (default 100)");
    inspect_cmd->add_option("NAME", inspect.name, "The lock or semaphore name (none: list the names in use)");
    inspect_cmd->footer(
        "The first line names the backend read (URL with credentials redacted). A file:// directory that\n"
        "does not exist is not created: nobody is queued there. Without NAME, one line per name whose\n"
        "queue has holders or waiters, with their counts (a listing takes at most 10 s).");
  }

  void add_gc(CLI::App& app) {
    gc_cmd = app.add_subcommand("gc", "Remove what the backend keeps for names nobody uses (file:// state files).");
    if (!builds(gc_cmd)) return;
    gc_backend_opt = gc_cmd->add_option("--backend", gc_backend,
                                        "Backend URL (default: $TURNSTILE_BACKEND, else the embedded default)");
    gc_cmd->add_flag("-q,--quiet", gc.quiet, "Print nothing; only the exit status tells");
    gc_cmd->add_flag("-v,--verbose", gc.verbose,
                     "Also say on stderr how many names' state it removed, and on which backend");
    gc_cmd->add_option("PREFIX", gc.prefix, "Only names starting with PREFIX (default: every name)");
    gc_cmd->footer(
        "Prints \"removed NAME\" for each name whose state it removed. A name held, waited for or keeping a\n"
        "PermitCounter value is never removed. On file:// a name's state file is removed by the last process\n"
        "using it; gc removes what crashed processes and earlier versions left. Network backends keep\n"
        "nothing once sessions end: there it removes nothing.");
  }

  void add_serve(CLI::App& app) {
    serve_cmd = app.add_subcommand("serve", "Serve /metrics (Prometheus) and a live web page of the names in use.");
    if (!builds(serve_cmd)) return;
    serve_backend_opt = serve_cmd->add_option("--backend", serve_backend,
                                              "Backend URL (default: $TURNSTILE_BACKEND, else the embedded default)");
    serve_cmd->add_option("--listen", serve.listen, "HOST:PORT to serve on (an IP address or localhost; port 0: any)")
        ->capture_default_str();
    serve_cmd->add_flag("--allow-remote", serve.allow_remote, "Allow --listen on an address that is not loopback");
    serve_cmd->add_option("--interval", serve.interval_sec, "Seconds between looks at the backend")
        ->capture_default_str()
        ->check(CLI::Range(0.1, 3600.0));
    serve_cmd->add_option("--max-names", serve.max_names, "Names looked at per look, 1 to 10000")
        ->capture_default_str()
        ->check(CLI::Range(1, 10000));
    serve_cmd->add_flag("--name-label", serve.name_label,
                        "Add per-name series to /metrics (a name label; the first 100 names)");
    serve_cmd
        ->add_option("--max-live-pages", serve.max_live_pages, "Live pages (event streams) open at once, 1 to 1000")
        ->capture_default_str()
        ->check(CLI::Range(1, 1000));
    serve_cmd->add_option("--connect-timeout", serve.connect_timeout_sec, "Seconds connecting to the backend may take")
        ->capture_default_str();
    serve_cmd->add_option("PREFIX", serve.prefix, "Only names that start with PREFIX (default: every name)");
    serve_cmd->footer(
        "Pages: / (the names in use, their holders and waiters in queue order; live), /state.json,\n"
        "/metrics (Prometheus text format), /events (the page's live stream). Prints the address it\n"
        "listens on; SIGINT or SIGTERM ends it. Credentials in the backend URL are never shown.");
  }

  void add_demo(CLI::App& app) {
    auto* demo_cmd = app.add_subcommand("demo", "Demonstrations.");
    if (!builds(demo_cmd)) return;
    demo_cmd->require_subcommand(1);
    parking_cmd = demo_cmd->add_subcommand("parking", "Cars (processes) share a parking lot (a Semaphore).");
    parking_cmd->add_option("--cars", parking.cars, "Number of cars, 1 to 1000")->capture_default_str();
    parking_cmd->add_option("--spaces", parking.spaces, "Number of spaces, 1 to 1000")->capture_default_str();
    parking_backend_opt =
        parking_cmd->add_option("--backend", parking_backend, "Backend URL (default: a fresh private directory)");
  }

  // Whether the subcommand parsed got its options (always, when all were made).
  bool parsed_one_built(const CLI::App& app) const {
    const auto parsed = app.get_subcommands();
    return only_.empty() || (parsed.size() == 1 && parsed.front()->get_name() == only_);
  }

  // Runs the subcommand parsed; `command` is what followed "--".
  int dispatch(std::vector<std::string> command) {
    if (run_cmd->parsed()) return dispatch_run(std::move(command));
    if (hold_cmd->parsed()) return dispatch_hold();
    if (elect_cmd->parsed()) return dispatch_elect(std::move(command));
    if (leader_cmd->parsed()) {
      take_if_given(leader_backend_opt, leader_backend, leader.backend);
      return leader_command(leader);
    }
    if (inspect_cmd->parsed()) {
      take_if_given(inspect_backend_opt, inspect_backend, inspect.backend);
      return inspect_command(inspect);
    }
    if (gc_cmd->parsed()) {
      take_if_given(gc_backend_opt, gc_backend, gc.backend);
      return gc_command(gc);
    }
    if (serve_cmd->parsed()) {
      take_if_given(serve_backend_opt, serve_backend, serve.backend);
      return serve_command(serve);
    }
    if (parking_cmd && parking_cmd->parsed()) {
      take_if_given(parking_backend_opt, parking_backend, parking.backend);
      return parking_demo(parking);
    }
    return kExitUsage;  // unreachable: a subcommand is required
  }

  int dispatch_run(std::vector<std::string> command) {
    const auto problem = run_flags.apply_with_flock_forms(run);
    take_if_given(run_shell, shell_value, run.shell);
    if (!problem.empty()) {
      complain(problem);
      // `run --lock job true`: "true" was taken for NAME.
      if (command.empty() && !run.shell) complain("put the command to run after '--'");
      return kExitUsage;
    }
    run.command = std::move(command);
    return run_command(run);
  }

  int dispatch_elect(std::vector<std::string> command) {
    elect_flags.apply_common(elect);
    if (elect_nonblock && elect.timeout_sec) {
      complain("give one of -n/--nonblock and --timeout");
      return kExitUsage;
    }
    if (elect_nonblock) elect.timeout_sec = 0;  // one try, as run -n
    elect.elect = elect_name;
    take_if_given(elect_value_opt, elect_value, elect.leader_value);
    take_if_given(elect_shell_opt, elect_shell, elect.shell);
    elect.command = std::move(command);
    return run_command(elect);
  }

  int dispatch_hold() {
    if (const auto problem = hold_flags.apply_with_flock_forms(hold); !problem.empty()) {
      complain(problem);
      return kExitUsage;
    }
    return hold_command(hold);
  }

 private:
  std::string only_;

  bool builds(const CLI::App* subcommand) const { return only_.empty() || subcommand->get_name() == only_; }
};

// CLI11's ExtrasError lists the arguments last first ("not expected: 1 -w"): in the user's order.
std::string not_expected(const CLI::App& app, const CLI::ParseError& error) {
  const auto extras = app.remaining(true);
  if (extras.empty()) return error.what();
  std::string text =
      extras.size() > 1 ? "The following arguments were not expected:" : "The following argument was not expected:";
  for (const auto& extra : extras) text += " " + printable(extra);
  return text;
}

// Says what is wrong with the command line (or prints --help); the exit status.
int parse_failure(const CLI::App& app, const CLI::ParseError& error, const std::vector<std::string>& args,
                  bool command_missing) {
  if (error.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(error);  // --help
  const std::vector<std::string> subcommands{"run", "hold", "elect", "leader", "inspect", "gc", "serve", "demo"};
  const bool unknown_subcommand = !args.empty() && !args.front().starts_with('-') &&
                                  std::find(subcommands.begin(), subcommands.end(), args.front()) == subcommands.end();
  complain(unknown_subcommand ? "unknown subcommand '" + printable(args.front()) +
                                    "' (expected run, hold, elect, leader, inspect, gc, serve or demo)"
           : dynamic_cast<const CLI::ExtrasError*>(&error) ? not_expected(app, error)
                                                           : std::string(error.what()));
  if (command_missing) complain("put the command to run after '--'");
  std::fprintf(stderr, "Run with --help for more information.\n");
  return kExitUsage;
}

// Parses `args` and runs the subcommand. With `only` set, only that subcommand gets its options:
// nullopt then when the line needs the others (a parse error, --help, another subcommand parsed),
// and nothing was run.
std::optional<int> parse_and_dispatch(const char* program, const std::vector<std::string>& args,
                                      std::vector<std::string>& command, const std::string& only) {
  CLI::App app{
      "Run commands under distributed locks and semaphores, keep a hold for a shell script, and inspect "
      "their queues.",
      "turnstile"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("turnstile ") + turnstile::version());
  Subcommands subcommands;
  subcommands.add_to(app, only);

  std::vector<const char*> parse_argv{program};
  for (const auto& arg : args) parse_argv.push_back(arg.c_str());
  try {
    app.parse(static_cast<int>(parse_argv.size()), parse_argv.data());
  } catch (const CLI::ParseError& error) {
    if (!only.empty()) return std::nullopt;
    const bool command_missing =
        subcommands.run_cmd->parsed() && command.empty() && subcommands.run_shell->count() == 0;
    return parse_failure(app, error, args, command_missing);
  }
  if (!subcommands.parsed_one_built(app)) return std::nullopt;
  return subcommands.dispatch(std::move(command));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string_view(argv[1]) == kReleaseReceiptCommand) return release_receipt_command();
  note_inherited_descriptors();
  ignore_sigpipe();
  std::vector<std::string> args(argv + 1, argv + argc);
  hide_credentials_in_arguments(argc, argv);
  std::vector<std::string> command = split_off_command(args);
  // Start-up: CLI11 spends some 16,000 instructions on each option it is given, about a third of
  // the instructions of `turnstile run` on file:// before it connects. So first only the
  // subcommand named first gets its options; a line that needs the others (an error, --help)
  // is parsed again with all of them, so it reads exactly as before.
  const std::vector<std::string> subcommand_names{"run", "hold", "elect", "leader", "inspect", "gc", "serve", "demo"};
  if (!args.empty() &&
      std::find(subcommand_names.begin(), subcommand_names.end(), args.front()) != subcommand_names.end()) {
    if (const auto status = parse_and_dispatch(argv[0], args, command, args.front())) return *status;
  }
  return *parse_and_dispatch(argv[0], args, command, "");
}
