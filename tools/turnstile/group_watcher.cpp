#include "group_watcher.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstddef>
#include <stdexcept>
#include <string>

#include "common.hpp"

namespace turnstile::cli {

GroupWatcher::GroupWatcher() {
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
  const int stat_fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
  // _Fork runs no atfork handlers: the child makes system calls only, as it must in a copy
  // of a process with library threads.
  pid_ = _Fork();
  if (pid_ < 0) {
    const int error = errno;
    for (int fd : {to_watcher[0], to_watcher[1], from_watcher[0], from_watcher[1], stat_fd}) {
      if (fd >= 0) close(fd);
    }
    errno = error;
    throw std::runtime_error(describe_errno("fork"));
  }
  if (pid_ == 0) {
    close(to_watcher[1]);
    close(from_watcher[0]);
    watch(stat_fd, to_watcher[0], from_watcher[1]);
  }
  if (stat_fd >= 0) close(stat_fd);
  close(to_watcher[0]);
  close(from_watcher[1]);
  write_fd_ = to_watcher[1];
  stopped_fd_ = from_watcher[0];
}

bool GroupWatcher::take_stopped() {
  char bytes[64];
  bool any = false;
  while (stopped_fd_ >= 0 && read(stopped_fd_, bytes, sizeof bytes) > 0) any = true;
  return any;
}

void GroupWatcher::dismiss() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    while (waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
  }
  for (int* fd : {&write_fd_, &stopped_fd_}) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
  }
}

bool GroupWatcher::stopped(int stat_fd) {
  char text[512];
  const ssize_t n = pread(stat_fd, text, sizeof text, 0);
  for (ssize_t i = n - 1; i > 0; --i) {  // "PID (COMM) STATE ...": COMM may hold ") "
    if (text[i] == ')') return i + 2 < n && text[i + 2] == 'T';
  }
  return false;
}

void GroupWatcher::watch(int stat_fd, int read_fd, int stopped_fd) {
  setsid();
  sigset_t all;
  sigfillset(&all);
  sigprocmask(SIG_SETMASK, &all, nullptr);
  for (int fd = 0; fd <= 2; ++fd) {
    if (fd != read_fd && fd != stopped_fd) close(fd);
  }
  pid_t group = 0;
  for (std::size_t got = 0; got < sizeof group;) {
    const ssize_t n = read(read_fd, reinterpret_cast<char*>(&group) + got, sizeof group - got);
    if (n == 0 || (n < 0 && errno != EINTR)) _exit(0);  // turnstile ended before running the command
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
  _exit(0);
}

}  // namespace turnstile::cli
