// The process that kills the command's group when turnstile dies and stops it while turnstile
// is stopped (see GroupWatcher).
#pragma once

#include <sys/types.h>

#include <chrono>

namespace turnstile::cli {

// Kills the command's process group if turnstile dies, SIGKILL included (PR_SET_PDEATHSIG
// covers only the direct child), and stops it while turnstile is stopped. A process of its own:
// forked before the command, in a session of its own, so no signal sent to turnstile's group,
// the command's group or the terminal reaches it; it learns the group from the command itself,
// before exec, and then waits for end-of-file on a pipe that only turnstile writes to, which
// comes when turnstile exits.
// It keeps the descriptors it inherited (the embedded backend's locks among them) until the
// group is killed, so a contender woken by turnstile's death cannot start before that.
// A stopped turnstile (SIGSTOP, a debugger) renews nothing, so its hold runs out while the
// command would run on: the watcher looks at turnstile's state every kStopCheck and stops the
// group (SIGSTOP) when it finds turnstile stopped, then tells turnstile through a second pipe.
// Continuing the group is turnstile's decision once it runs again (not if the hold was lost).
// Out of reach: processes that left the group (setsid, setpgid); only a cgroup could follow them.
class GroupWatcher {
 public:
  static constexpr auto kStopCheck = std::chrono::milliseconds(50);

  GroupWatcher();
  ~GroupWatcher() { dismiss(); }
  GroupWatcher(const GroupWatcher&) = delete;
  GroupWatcher& operator=(const GroupWatcher&) = delete;

  // Where the command writes its pid (= its group) before exec.
  int fd() const { return write_fd_; }
  // Readable when the watcher stopped the group because turnstile was stopped.
  int stopped_fd() const { return stopped_fd_; }
  // Clears stopped_fd(); true if the watcher had stopped the group.
  bool take_stopped();
  // The group is gone (or turnstile ends normally): the watcher goes without killing anything.
  void dismiss();
  // A child turnstile reaped: if it was the watcher (killed by someone), forget its pid.
  void reaped(pid_t pid) {
    if (pid == pid_) pid_ = -1;
  }

 private:
  // Whether the process whose /proc/PID/stat is open on `stat_fd` (turnstile) is stopped by a
  // signal ('T'; not 't', a tracer's stop, which comes and goes with every traced system call).
  static bool stopped(int stat_fd);

  [[noreturn]] static void watch(int stat_fd, int read_fd, int stopped_fd);

  pid_t pid_ = -1;
  int write_fd_ = -1;
  int stopped_fd_ = -1;
};

}  // namespace turnstile::cli
