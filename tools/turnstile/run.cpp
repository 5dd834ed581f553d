// SPDX-License-Identifier: Apache-2.0
// `turnstile run`: hold a lock or semaphore while a command runs.
//
// Signals: SIGINT/SIGTERM/SIGHUP/SIGQUIT, SIGCHLD and the job-control signals are blocked before
// any thread exists (so no library thread ever takes them) and read from a signalfd. Until the
// command starts, such a signal means it will not run: while we wait for the hold, a small
// thread reads them and cancels the wait, which leaves the queue; a hold taken meanwhile is
// given back. On a network backend that thread starts before connecting, and a signal while
// connecting exits at once (nothing is held yet; a silent server could hold a connect for
// seconds). Once the command runs, the main thread forwards them to its process group.
// An uncontended hold is taken by one try first; on file:// without that thread (the try is
// quick, and signals that came meanwhile are read right after it).
//
// The command runs in a process group of its own, so what is sent to turnstile's group (Ctrl-C
// without a terminal, `timeout`, `kill -INT -PGID`) reaches it once, through us; loss, forwarded
// signals and --pause-when-suspended act on the whole group. In the foreground of a terminal
// the command's group gets the terminal, and its job-control stops are passed on to the shell
// by stopping turnstile too. A watcher process kills the group if turnstile dies, SIGKILL
// included, then releases the hold on the server, and stops the group while turnstile is
// stopped (nobody renews the hold then). The main
// thread forks and stays alive until the command is reaped, because PR_SET_PDEATHSIG fires when
// the forking *thread* exits.
//
// Where each part lives: take_hold.cpp (connecting and taking the hold, shared with `turnstile
// hold`), acquire.cpp, signals.cpp (the signalfd and the AcquisitionGuard), command_group.cpp
// (starting the command, its process group), group_watcher.cpp, and here the supervising loop.
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <stop_token>

#include "acquire.hpp"
#include "command_group.hpp"
#include "commands.hpp"
#include "common.hpp"
#include "group_watcher.hpp"
#include "run_options.hpp"
#include "state_changes.hpp"
#include "take_hold.hpp"

namespace turnstile::cli {

namespace {

// After turnstile is continued (fg, SIGCONT after a SIGSTOP), the group is continued this much
// later: time for the library's loss clock, which ran out while turnstile was stopped, to report
// the loss first, so that a command whose hold expired meanwhile is stopped, not continued.
constexpr auto kSettleAfterContinue = std::chrono::milliseconds(100);

using Clock = std::chrono::steady_clock;

// The command as started: its pid (= its group), whether turnstile is interactive, and the
// errno of its failed exec (0 when it runs).
struct StartedCommand {
  pid_t child = -1;
  bool interactive = false;
  int exec_errno = 0;
};

// Starts the command under the hold's token, in a process group of its own that the watcher
// learns before anything of the command runs.
StartedCommand start_command(const Hold& hold, const std::string& name, const RunOptions& options,
                             const sigset_t& original_mask, GroupWatcher& watcher) {
  auto argv_strings = options.command;
  // `elect`: the command also sees the value it leads with.
  auto env_strings =
      child_environment(hold.token, name, options.elect ? std::optional<std::string>(hold.leader_value) : std::nullopt);
  auto argv = pointers(argv_strings);
  auto envp = pointers(env_strings);
  StartedCommand started;
  started.interactive = isatty(STDIN_FILENO) && tcgetsid(STDIN_FILENO) == getsid(0);
  const bool take_terminal = started.interactive && tcgetpgrp(STDIN_FILENO) == getpgrp();

  int error_pipe[2];
  if (pipe2(error_pipe, O_CLOEXEC) != 0) throw std::runtime_error(describe_errno("pipe"));
  std::fflush(nullptr);
  started.child = spawn(original_mask, argv.data(), envp.data(), error_pipe[1], watcher.fd(), take_terminal);
  if (started.child < 0) throw std::runtime_error(describe_errno("vfork"));
  close(error_pipe[1]);
  // EOF means exec succeeded (the pipe closed on exec); an int is the child's exec errno.
  ssize_t got;
  do {
    got = read(error_pipe[0], &started.exec_errno, sizeof started.exec_errno);
  } while (got < 0 && errno == EINTR);
  close(error_pipe[0]);
  return started;
}

// The loop that supervises the running command until its process group is gone: it reaps the
// group's processes, forwards signals, passes job-control stops on, pauses the group while the
// hold is suspended (--pause-when-suspended), and stops it when the hold may have been lost.
struct Supervision {
  Hold& hold;
  const std::string& name;
  const RunOptions& options;
  int signal_fd;
  const LossBounds& loss;
  StateChanges& changes;
  const LossAlarm& alarm;
  GroupWatcher& watcher;
  CommandGroup& group;

  bool lost = false;
  bool suspended = false;
  bool leader_exited = false;
  int wait_status = 0;
  std::optional<Clock::time_point> kill_at{};  // SIGKILL the group then
  bool killed = false;                         // the group got SIGKILL, at killed_at
  Clock::time_point killed_at{};
  std::optional<Clock::time_point> give_up_at{};   // stop waiting for the group to empty then
  std::optional<Clock::time_point> continue_at{};  // continue the group then (see kSettleAfterContinue)

  void run() {
    for (;;) {
      reap_children();
      const auto now = Clock::now();
      act_on_deadlines(now);
      if (leader_exited && group_done(now)) return;
      wait_and_dispatch(poll_timeout_ms(now));
    }
  }

  // What is left of the clean-up bound, counted from the SIGKILL or from now (the group is gone).
  Clock::time_point clean_up_until() const { return (killed ? killed_at : Clock::now()) + LossBounds::kCleanUp; }

 private:
  // The leader's exit or job-control stop; orphans of the group (we are their subreaper).
  void reap_children() {
    for (;;) {
      int status = 0;
      const pid_t pid = waitpid(-1, &status, WNOHANG | WUNTRACED);
      if (pid <= 0) return;
      if (pid != group.leader()) {
        // Killed by someone (`pkill -9 turnstile` kills it too): say what is unprotected now.
        if (watcher.reaped(pid)) {
          complain("its watcher (pid " + std::to_string(pid) +
                   ") was killed: should turnstile be killed too, nothing will stop the command's group, and "
                   "the hold ends only by its TTL");
        }
      } else if (!WIFSTOPPED(status)) {
        leader_exited = true;
        wait_status = status;
      } else if (const int sig = WSTOPSIG(status); sig == SIGTSTP || sig == SIGTTIN || sig == SIGTTOU) {
        group.stopped();
      }
    }
  }

  void act_on_deadlines(Clock::time_point now) {
    if (kill_at && now >= *kill_at) {
      group.signal(SIGKILL);
      kill_at.reset();
      killed = true;
      killed_at = now;
      give_up_at = now + LossBounds::kCleanUp;  // for members that die as zombies others must reap
    }
    if (continue_at && now >= *continue_at) {
      continue_at.reset();
      if (!lost) group.continue_group();
    }
  }

  // After the leader exited: whether the group is gone (or given up on); else stops what is left.
  bool group_done(Clock::time_point now) {
    if (!group.alive() || (give_up_at && now >= *give_up_at)) return true;
    // -o: what the command left runs on without the hold, as flock -o's children do.
    if (options.release_at_command_exit && !lost) return true;
    if (!kill_at && !killed) {
      if (!lost) complain("the command exited but left processes in its process group; stopping them");
      terminate_group(grace());
    }
    return false;
  }

  Clock::duration grace() const {
    return std::chrono::ceil<Clock::duration>(std::chrono::duration<double>(options.grace_sec));
  }

  // SIGTERM to the whole group now (continued, so it can act on it), SIGKILL after `after`.
  void terminate_group(Clock::duration after) {
    group.signal(SIGTERM);
    group.unpause();
    continue_at.reset();
    const auto at = Clock::now() + after;
    if (!killed && (!kill_at || at < *kill_at)) kill_at = at;
  }

  // Until the next deadline; leftovers may exit without telling us (their parent reaps them),
  // so after the leader's exit look again soon.
  int poll_timeout_ms(Clock::time_point now) const {
    int timeout_ms = leader_exited ? 20 : -1;
    for (const auto& at : {kill_at, give_up_at, continue_at}) {
      if (!at) continue;
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(*at - now).count();
      const int ms = static_cast<int>(std::clamp<std::int64_t>(left, 0, 60'000));
      timeout_ms = timeout_ms < 0 ? ms : std::min(timeout_ms, ms);
    }
    return timeout_ms;
  }

  void wait_and_dispatch(int timeout_ms) {
    // The alarm stays readable once rung: after the loss it is left out, or poll would return at once.
    pollfd fds[4] = {{signal_fd, POLLIN, 0},
                     {lost ? -1 : alarm.fd(), POLLIN, 0},
                     {changes.fd(), POLLIN, 0},
                     {watcher.stopped_fd(), POLLIN, 0}};
    if (poll(fds, 4, timeout_ms) < 0 && errno != EINTR) throw std::runtime_error(describe_errno("poll"));
    if (fds[2].revents & POLLIN) take_state_change();
    // The watcher stopped the group while turnstile was stopped; we run again, so continue it
    // (after the settling time) unless the hold was lost meanwhile.
    if ((fds[3].revents & POLLIN) && watcher.take_stopped() && !lost) {
      continue_at = Clock::now() + kSettleAfterContinue;
    }
    if (fds[0].revents & POLLIN) take_signal();
    if ((fds[1].revents & POLLIN) && !lost) take_loss();
  }

  void take_state_change() {
    // Always taken (else poll would spin); a lost hold is past suspending.
    const auto [state, reason] = changes.take();
    if (!lost && state == HoldState::suspended && !suspended) {
      suspended = true;
      complain("the hold on '" + name + "' is suspended (" + reason + "); " +
               (options.pause_when_suspended ? "pausing the command until it is confirmed"
                                             : "the command keeps running meanwhile"));
      if (options.pause_when_suspended) group.pause();
    } else if (!lost && state == HoldState::held && suspended) {
      suspended = false;
      complain("the hold on '" + name + "' is confirmed again" +
               (options.pause_when_suspended ? "; resuming the command" : ""));
      if (options.pause_when_suspended) group.unpause();
    }
  }

  void take_signal() {
    signalfd_siginfo info{};
    if (read(signal_fd, &info, sizeof info) != sizeof info) return;
    const int sig = static_cast<int>(info.ssi_signo);
    if (sig == SIGCONT) {
      if (!lost) continue_at = Clock::now() + kSettleAfterContinue;
    } else if (sig != SIGCHLD && sig != SIGTTIN && sig != SIGTTOU) {
      // The group gets nothing sent to turnstile's group or to turnstile directly, so this
      // delivers each signal exactly once. A forwarded SIGTSTP stops the command, whose stop
      // then stops turnstile.
      group.signal(sig);
    }
  }

  void take_loss() {
    lost = true;
    // SIGKILL at the latest half the library's margin after SIGTERM (the other half is left
    // for the kill itself); without one (none came, or the loss had none to give: the server
    // said the hold is gone, the embedded backend's state was removed), the bound from the TTL
    // turnstile knows.
    const auto margin = changes.loss_margin(std::chrono::milliseconds(20));
    const bool has_margin = margin && margin->count() > 0;
    const auto kill_after = has_margin ? std::chrono::duration_cast<Clock::duration>(*margin / 2) : loss.kill_after;
    terminate_group(std::min(grace(), kill_after));
    // Said once the command is being stopped: a stderr nobody reads must not delay that.
    complain("the hold on '" + name + "' (fencing token " + std::to_string(hold.token) +
             ") may have been lost; stopping the command");
  }
};

// turnstile's status for the command that ran (or could not be executed, said so).
int command_status(const StartedCommand& started, int wait_status, const RunOptions& options) {
  if (started.exec_errno == 0) return status_of(wait_status);
  const bool not_found = started.exec_errno == ENOENT || started.exec_errno == ENOTDIR;
  complain("cannot run '" + options.command.front() +
           "': " + (not_found ? std::string("command not found") : std::strerror(started.exec_errno)));
  return not_found ? kExitNotFound : kExitCannotExecute;
}

// Releases the hold after the command; false when it turned out lost before the release
// (perhaps while the command ran: it may have run unprotected).
bool released_as_held(Client& client, Hold& hold, const std::string& what, const RunOptions& options,
                      Clock::time_point started) {
  try {
    give_back(hold, options, started);
  } catch (const HoldLost& error) {
    complain(error.what());
    return false;
  } catch (const BackendUnavailable& error) {
    say_release_unconfirmed(client, what, error);
    return true;
  } catch (const Error& error) {
    complain(std::string("releasing the hold failed: ") + error.what());
  }
  if (options.verbose) complain("released " + what);
  return true;
}

// Runs the command under the hold; returns turnstile's exit status, or _exits with it when the
// hold was lost (no clean-up may wait on the network then). Releases the hold.
int supervise(Client& client, Hold& hold, const std::string& name, const std::string& what, const RunOptions& options,
              int signal_fd, const sigset_t& original_mask, const LossBounds& loss, StateChanges& changes) {
  const LossAlarm alarm(hold.lost);
  // Our descendants that lose their parent come to us, so leftovers of the command's group are
  // reaped here and the group empties.
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  // Should turnstile die holding, the watcher gives the hold back (see GroupWatcher); not with
  // --hold-at-least, whose hold must outlive the command: the TTL ends it then.
  const bool watcher_releases = !hold.receipt.empty() && !options.hold_at_least;
  GroupWatcher watcher(watcher_releases ? release_order(options.backend, hold.receipt) : std::string());
  const auto command_started = Clock::now();  // --hold-at-least counts from here
  const auto started = start_command(hold, name, options, original_mask, watcher);
  CommandGroup group(started.child, started.interactive);
  Supervision supervision{.hold = hold,
                          .name = name,
                          .options = options,
                          .signal_fd = signal_fd,
                          .loss = loss,
                          .changes = changes,
                          .alarm = alarm,
                          .watcher = watcher,
                          .group = group};
  supervision.run();
  const auto clean_up_until = supervision.clean_up_until();
  group.restore_terminal();
  // A watcher that releases stays until the release is confirmed: turnstile killed during it (a
  // slow server, kill -9 as the command ends) would otherwise leave the entry to the TTL; its
  // release by receipt removes this entry only, so one after ours removes nothing. Any other
  // goes now: on file:// it keeps copies of the name's descriptors, which must not outlive the
  // release (the last user's close removes the name's state file).
  if (!watcher_releases) watcher.dismiss();

  const int status = command_status(started, supervision.wait_status, options);
  if (!supervision.lost) {
    const bool released = released_as_held(client, hold, what, options, command_started);
    watcher.dismiss();
    if (released) return status;
  } else {
    watcher.dismiss();
    release_within(hold, std::max(Clock::duration::zero(), clean_up_until - Clock::now()));
  }
  // Lost: exit now. The client's clean-up could wait on a connection that is gone; the server's
  // expiry removes whatever is left.
  std::fflush(nullptr);
  _exit(started.exec_errno != 0 ? status : kExitHoldLost);
}

}  // namespace

int run_command(const RunOptions& given) {
  if (const auto problem = usage_problem(given, true); !problem.empty()) {
    complain(problem);
    return kExitUsage;
  }
  RunOptions options = given;
  if (options.shell) options.command = {"/bin/sh", "-c", *options.shell};
  return take_hold_then(options, [&](Client& client, Hold& hold, const std::string& what, int signal_fd,
                                     const sigset_t& original_mask, StateChanges& changes) {
    return supervise(client, hold, hold_name(options), what, options, signal_fd, original_mask,
                     loss_bounds(options, client.url()), changes);
  });
}

}  // namespace turnstile::cli
