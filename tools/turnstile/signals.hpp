// SPDX-License-Identifier: Apache-2.0
// The signals turnstile reads from its signalfd before the command runs: a job-control stop
// applied to turnstile itself, and a terminating signal that cancels the acquisition.
#pragma once

#include <unistd.h>

#include <csignal>

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <thread>

#include <sys/eventfd.h>

#include "common.hpp"

namespace turnstile::cli {

// Blocks the signals turnstile handles (terminating, SIGCHLD and job control) and returns a
// signalfd they wait in, or -1 (errno set). Called before any thread exists, so that every
// thread inherits the mask and no library thread ever takes them; `original_mask` is what the
// command gets back before exec.
int handled_signals_to_fd(sigset_t& original_mask);

// Stops turnstile as a job-control stop would (the shell sees it stopped), unless its process
// group is orphaned, where the kernel ignores such stops. SIGTSTP is blocked for the signalfd;
// raising it with this thread unblocked applies the default action.
void stop_self();

// Signals that only matter once a command runs, or not at all while we wait.
bool ignored_while_waiting(int sig);

// The signal watcher during acquisition: a signal cancels the acquisition (through the stop
// token: a waiter leaves the queue first, so on a network backend nobody waits for its expiry),
// and turnstile then exits 128 + signal without running the command, giving back a hold taken
// meanwhile. A second signal while the wait is being left exits at once, and so does the first
// when leaving takes too long. `disarm()` stops it once the acquisition has returned; signals
// that come later are read by the caller (see cancelling_signal).
//
// Started before connecting (`connecting_note` given), a signal until connected() exits at once:
// nothing is held yet, and a connect may wait for seconds on a server that does not answer.
class AcquisitionGuard {
 public:
  AcquisitionGuard(int signal_fd, std::string name, std::string connecting_note = {})
      : signal_fd_(signal_fd), name_(std::move(name)), connecting_note_(std::move(connecting_note)) {
    connecting_ = !connecting_note_.empty();
    stop_fd_ = eventfd(0, EFD_CLOEXEC);
    if (stop_fd_ < 0) throw std::runtime_error(describe_errno("eventfd"));
    thread_ = std::thread([this] { watch(); });
  }
  ~AcquisitionGuard() { disarm(); }
  AcquisitionGuard(const AcquisitionGuard&) = delete;
  AcquisitionGuard& operator=(const AcquisitionGuard&) = delete;

  std::stop_token token() const { return stop_.get_token(); }

  // Connected: from now on a signal cancels the acquisition instead.
  void connected() {
    std::lock_guard lock(mutex_);
    connecting_ = false;
  }

  // The signal that cancelled the acquisition, 0 if none did.
  int disarm() {
    if (thread_.joinable()) {
      const std::uint64_t one = 1;
      (void)!write(stop_fd_, &one, sizeof one);
      thread_.join();
      close(stop_fd_);
    }
    std::lock_guard lock(mutex_);
    return cancelled_by_;
  }

 private:
  void watch();

  // How long a cancelled acquisition may take to return.
  static constexpr auto kLeaveBound = std::chrono::seconds(2);

  int signal_fd_;
  int stop_fd_ = -1;
  std::string name_;
  std::string connecting_note_;  // what exiting while connecting means ("the command was not run")
  bool connecting_ = false;      // guarded by mutex_
  std::stop_source stop_;
  std::mutex mutex_;
  int cancelled_by_ = 0;
  std::thread thread_;
};

// The first signal, among those nobody has read yet, that cancels an acquisition (0 if none):
// they came before the command started, so it will not run. Job-control stops apply meanwhile.
int cancelling_signal(int signal_fd);

}  // namespace turnstile::cli
