// SPDX-License-Identifier: Apache-2.0
#include "command_group.hpp"

#include <dirent.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <string_view>
#include <utility>

#include "common.hpp"

extern char** environ;

namespace turnstile::cli {

std::vector<std::string> child_environment(std::uint64_t token, const std::string& name,
                                           const std::optional<std::string>& leader_value) {
  std::vector<std::string> env;
  for (char** entry = environ; *entry; ++entry) {
    const std::string_view text(*entry);
    if (text.starts_with("TURNSTILE_FENCING_TOKEN=") || text.starts_with("TURNSTILE_NAME=") ||
        text.starts_with("TURNSTILE_LEADER_VALUE=")) {
      continue;
    }
    env.emplace_back(text);
  }
  env.push_back("TURNSTILE_FENCING_TOKEN=" + std::to_string(token));
  env.push_back("TURNSTILE_NAME=" + name);
  if (leader_value) env.push_back("TURNSTILE_LEADER_VALUE=" + *leader_value);
  return env;
}

std::vector<char*> pointers(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

namespace {

std::vector<int> inherited_descriptors;  // above 2, sorted (note_inherited_descriptors)
struct sigaction inherited_sigpipe {};   // what turnstile was started with (ignore_sigpipe)
bool sigpipe_noted = false;

// The ranges of descriptors above 2 that were not inherited, for the child to mark.
std::vector<std::pair<unsigned, unsigned>> library_descriptor_ranges() {
  std::vector<std::pair<unsigned, unsigned>> ranges;
  unsigned from = 3;
  for (const int fd : inherited_descriptors) {
    if (static_cast<unsigned>(fd) > from) ranges.emplace_back(from, static_cast<unsigned>(fd) - 1);
    from = static_cast<unsigned>(fd) + 1;
  }
  ranges.emplace_back(from, UINT_MAX);
  return ranges;
}

}  // namespace

void ignore_sigpipe() {
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  sigpipe_noted = sigaction(SIGPIPE, &ignore, &inherited_sigpipe) == 0;
}

void note_inherited_descriptors() {
  DIR* listing = opendir("/proc/self/fd");
  if (!listing) return;  // no /proc: the library's own O_CLOEXEC is all there is
  const int own = dirfd(listing);
  while (const dirent* entry = readdir(listing)) {
    const int fd = std::atoi(entry->d_name);
    if (fd > 2 && fd != own) inherited_descriptors.push_back(fd);
  }
  closedir(listing);
  std::sort(inherited_descriptors.begin(), inherited_descriptors.end());
}

namespace {

// In the vforked child: only async-signal-safe calls (the parent has library threads), and
// nothing that writes to memory the parent uses beyond errno (it shares our address space).
[[noreturn]] void exec_child(pid_t parent, const sigset_t& original_mask, char** argv, char** envp, int error_fd,
                             int watcher_fd, bool take_terminal,
                             const std::vector<std::pair<unsigned, unsigned>>& library_ranges) {
  // A process group of its own, known to the watcher before anything of the command runs.
  setpgid(0, 0);
  const pid_t self = getpid();
  (void)!write(watcher_fd, &self, sizeof self);
  // In the terminal's foreground: the command gets the terminal (SIGTTOU is blocked here).
  if (take_terminal) tcsetpgrp(STDIN_FILENO, self);
  // Die with turnstile, even if it is SIGKILLed: the command must never run unprotected.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(kExitOsError);  // turnstile died before prctl took effect
  sigprocmask(SIG_SETMASK, &original_mask, nullptr);
  // The command gets SIGPIPE as turnstile got it (an ignored signal stays ignored across exec).
  if (sigpipe_noted) sigaction(SIGPIPE, &inherited_sigpipe, nullptr);
  // Only what turnstile inherited reaches the command (error_fd is close-on-exec already).
  for (const auto& [from, to] : library_ranges) close_range(from, to, CLOSE_RANGE_CLOEXEC);
  // glibc's execvpe searches PATH without allocating, and runs scripts without #! via sh.
  execvpe(argv[0], argv, envp);
  const int error = errno;
  (void)!write(error_fd, &error, sizeof error);
  _exit(error == ENOENT || error == ENOTDIR ? kExitNotFound : kExitCannotExecute);
}

}  // namespace

__attribute__((noinline)) pid_t spawn(const sigset_t& original_mask, char** argv, char** envp, int error_fd,
                                      int watcher_fd, bool take_terminal) {
  const pid_t parent = getpid();
  const auto library_ranges = library_descriptor_ranges();  // the child must not allocate
  const pid_t child = vfork();
  if (child == 0) exec_child(parent, original_mask, argv, envp, error_fd, watcher_fd, take_terminal, library_ranges);
  return child;
}

int status_of(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return kExitOsError;
}

}  // namespace turnstile::cli
