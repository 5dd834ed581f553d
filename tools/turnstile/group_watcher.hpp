// SPDX-License-Identifier: Apache-2.0
// The process that kills the command's group when turnstile dies and stops it while turnstile
// is stopped (see GroupWatcher).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>

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
//
// Release after turnstile's death. Turnstile killed without its release (SIGKILL, the OOM
// killer) leaves its entry on the server until the TTL. So once the group is gone the watcher
// gives the hold back, but it must not do it itself: it is a _Fork of a process with library
// threads (gRPC, the ZooKeeper client, hiredis' renewals), where only async-signal-safe calls
// are allowed, and the parent's client, its locks and connections are copies in any state.
// Instead it executes turnstile afresh (/proc/self/exe, the binary turnstile runs even if it was
// replaced since, with the hidden subcommand kReleaseReceiptCommand), a new process free to
// connect. What it needs, the --backend URL (which may carry credentials) and the hold's
// receipt (Client::release_receipt: exactly this entry, never another holder's), turnstile
// writes before the fork into a pipe the new process reads as its stdin: never argv or the
// environment, which other users may read in /proc. Only after a death: when turnstile ends
// normally it releases itself, then dismisses (kills) the watcher; killed before that, its
// watcher's release by receipt finishes the job (or finds the entry already gone). The group is killed
// first and the release waits (at most kGroupGone) until the group is gone, so the next holder
// can never overlap a process of the command; a group still there then is left to the TTL.
// The release is bounded (kReleaseByReceipt* in commands.hpp) and best effort.
class GroupWatcher {
 public:
  static constexpr auto kStopCheck = std::chrono::milliseconds(50);
  static constexpr auto kGroupGone = std::chrono::milliseconds(1000);

  // `release_order` (release_order()): what the release after turnstile's death reads; empty:
  // nothing to release then (file://: the hold ends with turnstile's descriptors).
  explicit GroupWatcher(const std::string& release_order = {});
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
  // From then on the kernel reaps turnstile's children (SA_NOCLDWAIT): call it only once the
  // command's status was read.
  void dismiss();
  // A child turnstile reaped: true if it was the watcher (killed by someone), whose pid is then
  // forgotten.
  bool reaped(pid_t pid) {
    if (pid != pid_) return false;
    pid_ = -1;
    return true;
  }

 private:
  // Whether the process whose /proc/PID/stat is open on `stat_fd` (turnstile) is stopped by a
  // signal ('T'; not 't', a tracer's stop, which comes and goes with every traced system call).
  static bool stopped(int stat_fd);

  // Descriptors and strings the watcher needs, all made before the fork.
  struct Inherited {
    int stat_fd = -1;
    int read_fd = -1;
    int stopped_fd = -1;
    int order_fd = -1;  // the release order, ready to read (-1: no release)
  };
  [[noreturn]] static void watch(const Inherited& inherited);
  // After the group: waits until it is gone, then executes the release (never returns).
  [[noreturn]] static void release_and_exit(pid_t group, int order_fd);
  // A pipe holding `order`, its read end returned (-1 when it cannot hold it).
  static int order_pipe(const std::string& order);

  pid_t pid_ = -1;
  int write_fd_ = -1;
  int stopped_fd_ = -1;
};

}  // namespace turnstile::cli
