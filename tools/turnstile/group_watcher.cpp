// SPDX-License-Identifier: Apache-2.0
#include "group_watcher.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstddef>
#include <stdexcept>
#include <string>

#include "commands.hpp"
#include "common.hpp"

namespace turnstile::cli {

GroupWatcher::GroupWatcher(const std::string& release_order) {
  int to_watcher[2], from_watcher[2];
  if (pipe2(to_watcher, O_CLOEXEC) != 0) throw std::runtime_error(describe_errno("pipe"));
  if (pipe2(from_watcher, O_CLOEXEC | O_NONBLOCK) != 0) {
    const int error = errno;
    close(to_watcher[0]);
    close(to_watcher[1]);
    errno = error;
    throw std::runtime_error(describe_errno("pipe"));
  }
  // Opened here: the child of _Fork may make system calls only. Without /proc, no stop checks.
  const Inherited inherited{.stat_fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC),
                            .read_fd = to_watcher[0],
                            .stopped_fd = from_watcher[1],
                            .order_fd = release_order.empty() ? -1 : order_pipe(release_order)};
  // _Fork runs no atfork handlers: the child makes system calls only, as it must in a copy
  // of a process with library threads.
  pid_ = _Fork();
  if (pid_ < 0) {
    const int error = errno;
    for (int fd :
         {to_watcher[0], to_watcher[1], from_watcher[0], from_watcher[1], inherited.stat_fd, inherited.order_fd}) {
      if (fd >= 0) close(fd);
    }
    errno = error;
    throw std::runtime_error(describe_errno("fork"));
  }
  if (pid_ == 0) {
    close(to_watcher[1]);
    close(from_watcher[0]);
    watch(inherited);
  }
  for (int fd : {inherited.stat_fd, inherited.order_fd}) {
    if (fd >= 0) close(fd);
  }
  close(to_watcher[0]);
  close(from_watcher[1]);
  write_fd_ = to_watcher[1];
  stopped_fd_ = from_watcher[0];
}

int GroupWatcher::order_pipe(const std::string& order) {
  int ends[2];
  if (order.size() > kMaxReleaseOrder || pipe2(ends, O_CLOEXEC | O_NONBLOCK) != 0) return -1;
  // Far below a pipe's capacity, so it is all written now, and the write end is closed: the
  // release reads it to its end.
  const bool whole = write(ends[1], order.data(), order.size()) == static_cast<ssize_t>(order.size());
  close(ends[1]);
  if (!whole) {
    close(ends[0]);
    return -1;
  }
  // Its reader gets it as a blocking stdin.
  fcntl(ends[0], F_SETFL, 0);
  return ends[0];
}

bool GroupWatcher::take_stopped() {
  char bytes[64];
  bool any = false;
  while (stopped_fd_ >= 0 && read(stopped_fd_, bytes, sizeof bytes) > 0) any = true;
  return any;
}

void GroupWatcher::dismiss() {
  if (pid_ > 0) {
    // Killed, not waited for: once kill() returns, SIGKILL is pending and the watcher runs no
    // more of its own code, so it can neither kill the group nor release. Waiting for it to be
    // scheduled and exit cost a run milliseconds on a busy machine. The kernel reaps it instead
    // (SA_NOCLDWAIT: no zombie, even under a PID 1 that never reaps); every child whose status
    // turnstile reads, the command's, was reaped before. The kill comes first, while the pid
    // is surely still ours; a watcher that died before the flag was set is reaped here.
    kill(pid_, SIGKILL);
    struct sigaction reap_by_kernel {};
    reap_by_kernel.sa_handler = SIG_DFL;
    reap_by_kernel.sa_flags = SA_NOCLDWAIT;
    sigaction(SIGCHLD, &reap_by_kernel, nullptr);
    waitpid(pid_, nullptr, WNOHANG);
    pid_ = -1;
  }
  for (int* fd : {&write_fd_, &stopped_fd_}) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
  }
}

namespace {

// Where a /proc/PID/stat text ("PID (COMM) STATE PPID PGRP ...") goes on after COMM, which may
// hold ") " itself: so after the last ')'. `rest` is null when the text is cut short.
struct StatHead {
  char state = '\0';
  const char* rest = nullptr;  // the fields after STATE
};

StatHead stat_head(const char* text, ssize_t n) {
  for (ssize_t i = n - 1; i >= 0; --i) {
    if (text[i] == ')') return i + 2 < n ? StatHead{text[i + 2], text + i + 3} : StatHead{};
  }
  return {};
}

}  // namespace

bool GroupWatcher::stopped(int stat_fd) {
  char text[512];
  return stat_head(text, pread(stat_fd, text, sizeof text, 0)).state == 'T';
}

void GroupWatcher::watch(const Inherited& inherited) {
  const auto [stat_fd, read_fd, stopped_fd, order_fd] = inherited;
  setsid();
  sigset_t all;
  sigfillset(&all);
  sigprocmask(SIG_SETMASK, &all, nullptr);
  for (int fd = 0; fd <= 2; ++fd) {
    if (fd != read_fd && fd != stopped_fd && fd != order_fd) close(fd);
  }
  pid_t group = 0;
  for (std::size_t got = 0; got < sizeof group;) {
    const ssize_t n = read(read_fd, reinterpret_cast<char*>(&group) + got, sizeof group - got);
    // Turnstile died holding, before it ran the command (a normal end dismisses us first).
    if (n == 0 || (n < 0 && errno != EINTR)) release_and_exit(0, order_fd);
    if (n > 0) got += static_cast<std::size_t>(n);
  }
  bool told = false;  // about the current stop of turnstile
  for (;;) {
    pollfd fd{read_fd, POLLIN, 0};
    const int ready = poll(&fd, 1, stat_fd < 0 ? -1 : static_cast<int>(kStopCheck.count()));
    if (ready < 0 && errno != EINTR) break;
    if (ready > 0) {
      char byte;
      const ssize_t n = read(read_fd, &byte, 1);
      if (n == 0 || (n < 0 && errno != EINTR)) break;
      continue;
    }
    if (!stopped(stat_fd)) {
      told = false;
    } else if (!told && group > 0) {
      kill(-group, SIGSTOP);
      const char byte = 1;
      (void)!write(stopped_fd, &byte, 1);
      told = true;
    }
  }
  if (group > 0) kill(-group, SIGKILL);
  release_and_exit(group, order_fd);
}

namespace {

// Whether the process whose /proc/PID/stat is `stat_path` is in `group` and not yet dead (a
// zombie, 'Z', or dying, 'X').
bool live_member(const char* stat_path, pid_t group) {
  const int fd = open(stat_path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char text[512];
  const ssize_t n = read(fd, text, sizeof text - 1);
  close(fd);
  if (n <= 0) return false;
  text[n] = '\0';
  const auto head = stat_head(text, n);
  if (!head.rest) return false;
  long fields[2] = {0, 0};  // PPID, PGRP
  const char* at = head.rest;
  for (long& field : fields) {
    while (*at == ' ') ++at;
    for (; *at >= '0' && *at <= '9'; ++at) field = field * 10 + (*at - '0');
  }
  return fields[1] == group && head.state != 'Z' && head.state != 'X';
}

// Whether a process of `group` still runs. A zombie has let go of everything it held, and may
// stay a zombie for long where init reaps late (seconds on some VMs; never in a container whose
// PID 1 does not reap): only live members count. Async-signal-safe (open/read/getdents64): the
// watcher is a fork of a process with threads.
bool group_runs(pid_t group) {
  const int proc = open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (proc < 0) return kill(-group, 0) == 0;  // no /proc: as before, zombies included
  alignas(8) char entries[4096];
  bool runs = false;
  for (long got; !runs && (got = syscall(SYS_getdents64, proc, entries, sizeof entries)) > 0;) {
    for (long at = 0; at < got && !runs;) {
      const auto* entry = reinterpret_cast<const dirent64*>(entries + at);
      at += entry->d_reclen;
      if (entry->d_name[0] < '1' || entry->d_name[0] > '9') continue;
      char path[64] = "/proc/";
      std::size_t length = 6;
      for (const char* c = entry->d_name; *c && length < sizeof path - 6; ++c) path[length++] = *c;
      for (const char* c = "/stat"; *c; ++c) path[length++] = *c;
      path[length] = '\0';
      runs = live_member(path, group);
    }
  }
  close(proc);
  return runs;
}

}  // namespace

void GroupWatcher::release_and_exit(pid_t group, int order_fd) {
  if (order_fd < 0) _exit(0);
  // Gone means dead (a zombie at most, as turnstile is dead and init reaps when it will): until
  // then the name stays held, so no new holder overlaps a process of the command.
  const auto step = std::chrono::milliseconds(10);
  for (auto waited = std::chrono::milliseconds(0); group > 0 && group_runs(group); waited += step) {
    if (waited >= kGroupGone) _exit(0);  // the TTL will do
    poll(nullptr, 0, static_cast<int>(step.count()));
  }
  if (dup2(order_fd, STDIN_FILENO) < 0) _exit(0);
  const int null = open("/dev/null", O_RDWR | O_CLOEXEC);
  if (null >= 0) {
    dup2(null, STDOUT_FILENO);
    dup2(null, STDERR_FILENO);
  }
  char program[] = "turnstile";
  char* argv[] = {program, const_cast<char*>(kReleaseReceiptCommand), nullptr};
  execve("/proc/self/exe", argv, environ);
  _exit(0);
}

}  // namespace turnstile::cli
