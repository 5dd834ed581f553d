// SPDX-License-Identifier: Apache-2.0
#include "signals.hpp"

#include <poll.h>
#include <sys/signalfd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <optional>

namespace turnstile::cli {

int handled_signals_to_fd(sigset_t& original_mask) {
  sigset_t handled;
  sigemptyset(&handled);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD, SIGTSTP, SIGCONT, SIGTTIN, SIGTTOU}) {
    sigaddset(&handled, sig);
  }
  pthread_sigmask(SIG_BLOCK, &handled, &original_mask);
  return signalfd(-1, &handled, SFD_CLOEXEC);
}

void stop_self() {
  sigset_t tstp;
  sigemptyset(&tstp);
  sigaddset(&tstp, SIGTSTP);
  pthread_sigmask(SIG_UNBLOCK, &tstp, nullptr);
  raise(SIGTSTP);
  pthread_sigmask(SIG_BLOCK, &tstp, nullptr);
}

bool ignored_while_waiting(int sig) { return sig == SIGCHLD || sig == SIGCONT || sig == SIGTTIN || sig == SIGTTOU; }

void AcquisitionGuard::watch() {
  pollfd fds[2] = {{signal_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
  std::optional<std::chrono::steady_clock::time_point> exit_at;
  for (;;) {
    int timeout_ms = -1;
    if (exit_at) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(*exit_at - std::chrono::steady_clock::now());
      timeout_ms = static_cast<int>(std::max<std::int64_t>(0, left.count()));
    }
    const int ready = poll(fds, 2, timeout_ms);
    if (ready < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents) return;
    if (ready == 0) {
      // Leaving the queue is the backend's to bound; if it does not, exiting still drops
      // whatever the kernel or the server's expiry can drop.
      std::fprintf(stderr, "turnstile: could not leave the queue of '%s' in time; exiting\n", name_.c_str());
      _exit(128 + cancelled_by_);
    }
    signalfd_siginfo info{};
    if (read(signal_fd_, &info, sizeof info) != sizeof info) continue;
    const int sig = static_cast<int>(info.ssi_signo);
    if (ignored_while_waiting(sig)) continue;
    if (sig == SIGTSTP) {  // Ctrl-Z while waiting: stop like any job
      stop_self();
      continue;
    }
    std::lock_guard lock(mutex_);
    if (connecting_) {
      std::fprintf(stderr, "turnstile: %s while connecting; %s\n", strsignal(sig), connecting_note_.c_str());
      _exit(128 + sig);
    }
    if (cancelled_by_ != 0) {
      std::fprintf(stderr, "turnstile: %s again; exiting without waiting to leave the queue\n", strsignal(sig));
      _exit(128 + sig);
    }
    cancelled_by_ = sig;
    stop_.request_stop();
    exit_at = std::chrono::steady_clock::now() + kLeaveBound;
  }
}

int cancelling_signal(int signal_fd) {
  int first = 0;
  pollfd fd{signal_fd, POLLIN, 0};
  while (poll(&fd, 1, 0) == 1 && (fd.revents & POLLIN)) {
    signalfd_siginfo info{};
    if (read(signal_fd, &info, sizeof info) != sizeof info) break;
    const int sig = static_cast<int>(info.ssi_signo);
    if (ignored_while_waiting(sig)) continue;
    if (sig == SIGTSTP) {
      stop_self();
    } else if (first == 0) {
      first = sig;
    }
  }
  return first;
}

}  // namespace turnstile::cli
