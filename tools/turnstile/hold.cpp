// SPDX-License-Identifier: Apache-2.0
// `turnstile hold`: take a hold and keep it for a shell script until told to let go.
#include <poll.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <string_view>

#include "acquire.hpp"
#include "commands.hpp"
#include "common.hpp"
#include "run_options.hpp"
#include "signals.hpp"
#include "state_changes.hpp"
#include "take_hold.hpp"

namespace turnstile::cli {

namespace {

// Whether `fd` is a pipe, FIFO or socket: what a script gives `turnstile hold` to talk with it
// (coproc, a pipeline, process substitution). A terminal is the user's (reading it would take
// their input), and /dev/null or a file would end the hold at once.
bool is_channel(int fd) {
  struct stat st {};
  return fstat(fd, &st) == 0 && (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode));
}

bool write_all(int fd, std::string_view text) {
  while (!text.empty()) {
    const ssize_t n = write(fd, text.data(), text.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    text.remove_prefix(static_cast<std::size_t>(n));
  }
  return true;
}

// Says when the hold is suspended and when it is confirmed again.
void report_state_change(StateChanges& changes, const std::string& name, bool& suspended) {
  const auto [state, reason] = changes.take();
  if (state == HoldState::suspended && !suspended) {
    suspended = true;
    complain("the hold on '" + name + "' is suspended (" + reason + ")");
  } else if (state == HoldState::held && suspended) {
    suspended = false;
    complain("the hold on '" + name + "' is confirmed again");
  }
}

// The name of a terminating signal read from `signal_fd`, "" for any other (a Ctrl-Z stops
// turnstile meanwhile).
std::string terminating_signal(int signal_fd) {
  signalfd_siginfo info{};
  if (read(signal_fd, &info, sizeof info) != sizeof info) return {};
  const int sig = static_cast<int>(info.ssi_signo);
  if (sig == SIGTSTP) {
    stop_self();
  } else if (sig == SIGINT || sig == SIGTERM || sig == SIGHUP || sig == SIGQUIT) {
    return strsignal(sig);
  }
  return {};
}

// "stdin closed" once stdin reached its end. Whatever is written to it means nothing.
std::string stdin_end() {
  char bytes[4096];
  const ssize_t n = read(STDIN_FILENO, bytes, sizeof bytes);
  return n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN) ? "stdin closed" : "";
}

// Why the hold was let go (a signal's name, "stdin closed", ...), or that it was lost first.
struct LetGo {
  std::string ended_by;
  bool lost = false;
};

// Keeps the hold until `ended_by` says why it ends: stdin (a pipe) reaches its end, the reader
// of stdout (a pipe) goes away, or a terminating signal comes; or until it is lost.
LetGo keep_until_let_go(int signal_fd, const LossAlarm& alarm, StateChanges& changes, const std::string& name,
                        std::string ended_by) {
  const bool watch_stdin = is_channel(STDIN_FILENO);
  const bool watch_stdout = is_channel(STDOUT_FILENO);
  bool suspended = false;
  while (ended_by.empty()) {
    // A pollfd of -1 is skipped; stdout is polled for nothing but its errors (reader gone).
    pollfd fds[5] = {{signal_fd, POLLIN, 0},
                     {alarm.fd(), POLLIN, 0},
                     {changes.fd(), POLLIN, 0},
                     {watch_stdin ? STDIN_FILENO : -1, POLLIN, 0},
                     {watch_stdout ? STDOUT_FILENO : -1, 0, 0}};
    if (poll(fds, 5, -1) < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(describe_errno("poll"));
    }
    if (fds[1].revents & POLLIN) return {ended_by, true};
    if (fds[2].revents & POLLIN) report_state_change(changes, name, suspended);
    if (fds[0].revents & POLLIN) {
      if (auto by_signal = terminating_signal(signal_fd); !by_signal.empty()) ended_by = std::move(by_signal);
    }
    if (fds[3].revents) {
      if (auto end = stdin_end(); !end.empty()) ended_by = std::move(end);
    }
    if (fds[4].revents & (POLLERR | POLLHUP | POLLNVAL)) ended_by = "the reader of stdout went away";
  }
  return {ended_by, false};
}

// The hold may have been lost: gives the release a bounded try and exits 70. The client's
// clean-up could wait on a connection that is gone; the server's expiry removes whatever is left.
[[noreturn]] void exit_lost(Hold& hold, const std::string& name) {
  complain("the hold on '" + name + "' (fencing token " + std::to_string(hold.token) + ") may have been lost");
  release_within(hold, LossBounds::kCleanUp);
  std::fflush(nullptr);
  _exit(kExitHoldLost);
}

// Releases the hold kept until `ended_by`; the exit status.
int release_kept(Client& client, Hold& hold, const std::string& what, const RunOptions& options,
                 const std::string& ended_by, std::chrono::steady_clock::time_point taken) {
  int status = ended_by == "error" ? kExitOsError : 0;
  try {
    give_back(hold, options, taken);
    if (options.verbose) complain("released " + what + " (" + ended_by + ")");
  } catch (const HoldLost& error) {
    complain(error.what());
    status = kExitHoldLost;
  } catch (const BackendUnavailable& error) {
    say_release_unconfirmed(client, what, error);
    status = exit_status_for(error);
  } catch (const Error& error) {
    complain(std::string("releasing the hold failed: ") + error.what());
    status = exit_status_for(error);
  }
  return status;
}

// `turnstile hold`: prints the token and keeps the hold until told to let go (see
// keep_until_let_go); then releases it. Returns 0 when it was kept until then; _exits 70 when
// it was lost meanwhile.
int keep(Client& client, Hold& hold, const std::string& what, const RunOptions& options, int signal_fd,
         StateChanges& changes) {
  const LossAlarm alarm(hold.lost);
  const auto taken = std::chrono::steady_clock::now();  // --hold-at-least counts from here
  std::string ended_by;
  if (!write_all(STDOUT_FILENO, std::to_string(hold.token) + "\n")) {
    complain(describe_errno("cannot write the fencing token to stdout") + "; releasing");
    ended_by = "error";
  }
  const auto let_go = keep_until_let_go(signal_fd, alarm, changes, hold_name(options), ended_by);
  // Lost while kept, or as we were told to let go.
  if (let_go.lost || hold.lost.stop_requested()) exit_lost(hold, hold_name(options));
  return release_kept(client, hold, what, options, let_go.ended_by, taken);
}

}  // namespace

int hold_command(const RunOptions& options) {
  if (const auto problem = usage_problem(options, false); !problem.empty()) {
    complain(problem);
    return kExitUsage;
  }
  // A reader of stdout that went away is an error on write, not a signal that kills us.
  ::signal(SIGPIPE, SIG_IGN);
  return take_hold_then(options,
                        [&](Client& client, Hold& hold, const std::string& what, int signal_fd, const sigset_t&,
                            StateChanges& changes) { return keep(client, hold, what, options, signal_fd, changes); });
}

}  // namespace turnstile::cli
