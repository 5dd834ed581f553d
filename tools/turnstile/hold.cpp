// `turnstile hold`: take a hold and keep it for a shell script until told to let go.
#include <poll.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <stop_token>
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

// `turnstile hold`: prints the token and keeps the hold until stdin (a pipe) reaches its end,
// the reader of stdout (a pipe) goes away, or a terminating signal comes; then releases it.
// Returns 0 when it was kept until then; _exits 70 when it was lost meanwhile.
int keep(Hold& hold, const std::string& what, const RunOptions& options, int signal_fd,
         StateChanges& changes) {
  const int lost_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (lost_fd < 0) throw std::runtime_error(describe_errno("eventfd"));
  const auto wake = [lost_fd] {
    const std::uint64_t one = 1;
    (void)!write(lost_fd, &one, sizeof one);
  };
  std::optional<std::stop_callback<decltype(wake)>> on_loss(std::in_place, hold.lost, wake);

  std::string ended_by;
  if (!write_all(STDOUT_FILENO, std::to_string(hold.token) + "\n")) {
    complain(describe_errno("cannot write the fencing token to stdout") + "; releasing");
    ended_by = "error";
  }
  const bool watch_stdin = is_channel(STDIN_FILENO);
  const bool watch_stdout = is_channel(STDOUT_FILENO);
  bool lost = false, suspended = false;
  while (ended_by.empty()) {
    // A pollfd of -1 is skipped; stdout is polled for nothing but its errors (reader gone).
    pollfd fds[5] = {{signal_fd, POLLIN, 0}, {lost_fd, POLLIN, 0}, {changes.fd(), POLLIN, 0},
                     {watch_stdin ? STDIN_FILENO : -1, POLLIN, 0}, {watch_stdout ? STDOUT_FILENO : -1, 0, 0}};
    if (poll(fds, 5, -1) < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(describe_errno("poll"));
    }
    if (fds[1].revents & POLLIN) {
      lost = true;
      break;
    }
    if (fds[2].revents & POLLIN) {
      const auto [state, reason] = changes.take();
      if (state == HoldState::suspended && !suspended) {
        suspended = true;
        complain("the hold on '" + hold_name(options) + "' is suspended (" + reason + ")");
      } else if (state == HoldState::held && suspended) {
        suspended = false;
        complain("the hold on '" + hold_name(options) + "' is confirmed again");
      }
    }
    if (fds[0].revents & POLLIN) {
      signalfd_siginfo info{};
      if (read(signal_fd, &info, sizeof info) == sizeof info) {
        const int sig = static_cast<int>(info.ssi_signo);
        if (sig == SIGTSTP) {
          stop_self();
        } else if (sig == SIGINT || sig == SIGTERM || sig == SIGHUP || sig == SIGQUIT) {
          ended_by = strsignal(sig);
        }
      }
    }
    if (fds[3].revents) {
      // Whatever is written to stdin means nothing; its end is the signal to let go.
      char bytes[4096];
      const ssize_t n = read(STDIN_FILENO, bytes, sizeof bytes);
      if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) ended_by = "stdin closed";
    }
    if (fds[4].revents & (POLLERR | POLLHUP | POLLNVAL)) ended_by = "the reader of stdout went away";
  }
  if (!lost && hold.lost.stop_requested()) lost = true;  // lost as we were told to let go
  if (lost) {
    complain("the hold on '" + hold_name(options) + "' (fencing token " + std::to_string(hold.token) +
             ") may have been lost");
    release_within(hold, LossBounds::kCleanUp);
    // The client's clean-up could wait on a connection that is gone; the server's expiry
    // removes whatever is left.
    std::fflush(nullptr);
    _exit(kExitHoldLost);
  }
  int status = ended_by == "error" ? kExitOsError : 0;
  try {
    hold.release();
    if (options.verbose) complain("released " + what + " (" + ended_by + ")");
  } catch (const HoldLost& error) {
    complain(error.what());
    status = kExitHoldLost;
  } catch (const Error& error) {
    complain(std::string("releasing the hold failed: ") + error.what());
    status = exit_status_for(error);
  }
  on_loss.reset();  // waits for a callback running right now
  close(lost_fd);
  return status;
}

}  // namespace

int hold_command(const RunOptions& options) {
  if (const auto problem = usage_problem(options, false); !problem.empty()) {
    complain(problem);
    return kExitUsage;
  }
  // A reader of stdout that went away is an error on write, not a signal that kills us.
  ::signal(SIGPIPE, SIG_IGN);
  return take_hold_then(options, [&](Client&, Hold& hold, const std::string& what, int signal_fd, const sigset_t&,
                                     StateChanges& changes) {
    return keep(hold, what, options, signal_fd, changes);
  });
}

}  // namespace turnstile::cli
