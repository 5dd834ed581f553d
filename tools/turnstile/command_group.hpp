// SPDX-License-Identifier: Apache-2.0
// The command turnstile runs: its environment, its start in a process group of its own, its
// exit status, and that group with the terminal it gets while turnstile is in the foreground.
#pragma once

#include <sys/types.h>
#include <termios.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "signals.hpp"

namespace turnstile::cli {

// The child's environment: ours with TURNSTILE_FENCING_TOKEN and TURNSTILE_NAME set.
std::vector<std::string> child_environment(std::uint64_t token, const std::string& name,
                                           const std::optional<std::string>& leader_value = std::nullopt);

// The argv/envp form of `strings`, which must outlive it.
std::vector<char*> pointers(std::vector<std::string>& strings);

// Notes the descriptors turnstile was started with (called first thing in main): the command
// inherits those and 0-2, and none of the library's (spawn marks every other one close-on-exec
// in the child: a library that sets FD_CLOEXEC after socket(), as gRPC does, races our fork).
void note_inherited_descriptors();

// turnstile itself ignores SIGPIPE (called first thing in main): a reader of its stdout or
// stderr that went away (`2>&1 | head`, a dead log pipe) must be a failed write, not a death
// that leaves a hold taken and its command never run. Commands get the disposition turnstile
// was started with back before exec.
void ignore_sigpipe();

// vfork: the child shares our memory until it execs, so no page tables are copied and we
// take no copy-on-write faults afterwards (most of a fork's cost here). That is safe because
// exec_child only makes system calls on its own stack frame, and we are suspended meanwhile.
// A function of its own, so no variable of the caller lives across vfork.
pid_t spawn(const sigset_t& original_mask, char** argv, char** envp, int error_fd, int watcher_fd, bool take_terminal);

// turnstile's exit status for the command's wait status: its own, or 128 + the signal that killed it.
int status_of(int wait_status);

// The command's process group, and the terminal it gets while turnstile is in the foreground.
class CommandGroup {
 public:
  CommandGroup(pid_t leader, bool interactive) : leader_(leader), interactive_(interactive) {}
  pid_t leader() const { return leader_; }
  void signal(int sig) const { kill(-leader_, sig); }
  // Some process of the group is left (a zombie nobody reaped counts).
  bool alive() const { return kill(-leader_, 0) == 0; }

  // The command stopped for job control (Ctrl-Z, or reading the terminal in the background):
  // pass it on to the shell by stopping turnstile too, with the terminal back in our group.
  void stopped() {
    if (interactive_ && tcgetpgrp(STDIN_FILENO) == leader_) tcsetpgrp(STDIN_FILENO, getpgrp());
    stop_self();
    sigset_t pending;
    sigpending(&pending);
    if (!sigismember(&pending, SIGCONT)) continue_group();  // an orphaned group does not stop
  }
  // Turnstile was continued (fg, bg): the command too, with the terminal if we have it.
  void continue_group() {
    if (interactive_ && tcgetpgrp(STDIN_FILENO) == getpgrp()) tcsetpgrp(STDIN_FILENO, leader_);
    if (!paused_) signal(SIGCONT);
  }
  // --pause-when-suspended.
  void pause() {
    paused_ = true;
    signal(SIGSTOP);
  }
  void unpause() {
    paused_ = false;
    signal(SIGCONT);
  }
  // The command is done: the terminal goes back to our group if the command's group has it.
  void restore_terminal() {
    if (interactive_ && tcgetpgrp(STDIN_FILENO) == leader_) tcsetpgrp(STDIN_FILENO, getpgrp());
  }

 private:
  pid_t leader_;
  bool interactive_;
  bool paused_ = false;
};

}  // namespace turnstile::cli
