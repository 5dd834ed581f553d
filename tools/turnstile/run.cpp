// `turnstile run`: hold a lock or semaphore while a command runs.
//
// Signals: SIGINT/SIGTERM/SIGHUP/SIGQUIT, SIGCHLD and the job-control signals are blocked before
// any thread exists (so no library thread ever takes them) and read from a signalfd. While we
// wait for the hold, a small thread reads them and cancels the wait, which leaves the queue;
// once we hold, the main thread forwards them to the command's process group.
// An uncontended hold is taken by one try first, without that thread (a try cannot block).
//
// The command runs in a process group of its own, so what is sent to turnstile's group (Ctrl-C
// without a terminal, `timeout`, `kill -INT -PGID`) reaches it once, through us; loss, forwarded
// signals and --pause-when-suspended act on the whole group. In the foreground of a terminal
// the command's group gets the terminal, and its job-control stops are passed on to the shell
// by stopping turnstile too. A watcher process kills the group if turnstile dies, SIGKILL
// included. The main thread forks and stays alive until the command is reaped, because
// PR_SET_PDEATHSIG fires when the forking *thread* exits.
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <thread>
#include <vector>

#include "commands.hpp"
#include "common.hpp"

extern char** environ;

namespace turnstile::cli {
namespace {

// What the command runs under, whichever primitive it is.
struct Hold {
  std::uint64_t token = 0;
  std::stop_token lost;
  std::function<void()> release;  // throws HoldLost when the hold was lost meanwhile
};

enum class Kind { lock, read, write, semaphore };

// The hold's suspensions and recoveries (its loss comes through its stop token), from the
// library's thread to the supervising loop: the latest state, and an eventfd that wakes it.
// Made before the client, so it outlives every callback.
class StateChanges {
 public:
  StateChanges() : fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
    if (fd_ < 0) throw std::runtime_error("eventfd: " + std::string(std::strerror(errno)));
  }
  ~StateChanges() { close(fd_); }
  StateChanges(const StateChanges&) = delete;
  StateChanges& operator=(const StateChanges&) = delete;

  void record(const HoldStateChange& change) {
    if (change.state == HoldState::lost) return;
    {
      std::lock_guard lock(mutex_);
      state_ = change.state;
      reason_ = change.reason;
    }
    const std::uint64_t one = 1;
    (void)!write(fd_, &one, sizeof one);
  }
  int fd() const { return fd_; }
  // The latest state and why; clears the wake-up.
  std::pair<HoldState, std::string> take() {
    std::uint64_t count;
    (void)!read(fd_, &count, sizeof count);
    std::lock_guard lock(mutex_);
    return {state_, reason_};
  }

 private:
  int fd_;
  std::mutex mutex_;
  HoldState state_ = HoldState::held;
  std::string reason_;
};

std::string describe_errno(const std::string& what) { return what + ": " + std::strerror(errno); }

// Stops turnstile as a job-control stop would (the shell sees it stopped), unless its process
// group is orphaned, where the kernel ignores such stops. SIGTSTP is blocked for the signalfd;
// raising it with this thread unblocked applies the default action.
void stop_self() {
  sigset_t tstp;
  sigemptyset(&tstp);
  sigaddset(&tstp, SIGTSTP);
  pthread_sigmask(SIG_UNBLOCK, &tstp, nullptr);
  raise(SIGTSTP);
  pthread_sigmask(SIG_BLOCK, &tstp, nullptr);
}

// Signals that only matter once a command runs, or not at all while we wait.
bool ignored_while_waiting(int sig) { return sig == SIGCHLD || sig == SIGCONT || sig == SIGTTIN || sig == SIGTTOU; }

// The signal watcher during acquisition: a signal cancels the wait (through the stop token:
// the waiter leaves the queue first, so on a network backend nobody waits for its expiry), and
// turnstile then exits 128 + signal without running the command. A second signal while the
// wait is being left exits at once. Once the hold is taken, `disarm()` stops it; signals it read
// after the hold was taken are handed back for forwarding to the command.
class AcquisitionGuard {
 public:
  AcquisitionGuard(int signal_fd, std::string name) : signal_fd_(signal_fd), name_(std::move(name)) {
    stop_fd_ = eventfd(0, EFD_CLOEXEC);
    if (stop_fd_ < 0) throw std::runtime_error(describe_errno("eventfd"));
    thread_ = std::thread([this] { watch(); });
  }
  ~AcquisitionGuard() { disarm(); }

  std::stop_token token() const { return stop_.get_token(); }

  struct Outcome {
    int cancelled_by = 0;      // the signal that cancelled the wait, 0 if none did
    std::vector<int> pending;  // signals read after the hold was taken
  };
  Outcome disarm() {
    {
      std::lock_guard lock(mutex_);
      acquired_ = true;
    }
    if (thread_.joinable()) {
      const std::uint64_t one = 1;
      (void)!write(stop_fd_, &one, sizeof one);
      thread_.join();
      close(stop_fd_);
    }
    std::lock_guard lock(mutex_);
    return {cancelled_by_, std::move(pending_)};
  }

 private:
  void watch() {
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
      if (acquired_ || cancelled_by_ != 0) {
        if (acquired_) {
          pending_.push_back(sig);
          continue;
        }
        std::fprintf(stderr, "turnstile: %s again; exiting without waiting to leave the queue\n", strsignal(sig));
        _exit(128 + sig);
      }
      cancelled_by_ = sig;
      stop_.request_stop();
      exit_at = std::chrono::steady_clock::now() + kLeaveBound;
    }
  }

  // How long a cancelled wait may take to leave the queue.
  static constexpr auto kLeaveBound = std::chrono::seconds(2);

  int signal_fd_;
  int stop_fd_ = -1;
  std::string name_;
  std::stop_source stop_;
  std::mutex mutex_;
  bool acquired_ = false;
  int cancelled_by_ = 0;
  std::vector<int> pending_;
  std::thread thread_;
};

// How long acquire() may wait: nothing (one try), until a deadline, or forever.
using Wait = std::optional<std::optional<std::chrono::steady_clock::time_point>>;
constexpr Wait kTryOnce = std::nullopt;

// Takes the hold; nullopt when the wait ended first (deadline, or `stop` requested: the waiter
// has then left the queue).
std::optional<Hold> acquire(Client& client, Kind kind, const std::string& name, const RunOptions& options,
                            const Wait& wait, std::stop_token stop = {}) {
  const bool once = !wait.has_value();
  const bool forever = wait.has_value() && !wait->has_value();
  // The stop-token overloads take a duration; the deadline counts from before the first try.
  const auto left = [&] {
    return std::max(std::chrono::steady_clock::duration::zero(), **wait - std::chrono::steady_clock::now());
  };
  switch (kind) {
    case Kind::lock: {
      auto mutex = std::make_shared<Mutex>(client.mutex(name));
      const bool got = once ? mutex->try_lock() : forever ? mutex->lock(stop) : mutex->try_lock_for(left(), stop);
      if (!got) return std::nullopt;
      return Hold{mutex->fencing_token(), mutex->lost_token(), [mutex] { mutex->release(); }};
    }
    case Kind::read:
    case Kind::write: {
      auto rw = std::make_shared<SharedMutex>(client.shared_mutex(name));
      bool got;
      if (kind == Kind::read) {
        got = once ? rw->try_lock_shared() : forever ? rw->lock_shared(stop) : rw->try_lock_shared_for(left(), stop);
      } else {
        got = once ? rw->try_lock() : forever ? rw->lock(stop) : rw->try_lock_for(left(), stop);
      }
      if (!got) return std::nullopt;
      auto release = kind == Kind::read ? std::function<void()>([rw] { rw->release_shared(); })
                                        : std::function<void()>([rw] { rw->release(); });
      return Hold{rw->fencing_token(), rw->lost_token(), std::move(release)};
    }
    case Kind::semaphore: {
      auto semaphore = client.semaphore(name, *options.limit);
      std::optional<Lease> lease = once      ? semaphore.try_acquire()
                                   : forever ? semaphore.acquire(1, stop)
                                             : semaphore.try_acquire_for(left(), 1, stop);
      if (!lease) return std::nullopt;
      auto shared = std::make_shared<Lease>(std::move(*lease));
      return Hold{shared->fencing_token(), shared->lost_token(), [shared] { shared->release(); }};
    }
  }
  return std::nullopt;
}

// Signals that came while the hold was being tried, without the guard thread: each is handed
// to the command, as the guard does with signals it reads once the hold is taken.
std::vector<int> pending_signals(int signal_fd) {
  std::vector<int> signals;
  pollfd fd{signal_fd, POLLIN, 0};
  while (poll(&fd, 1, 0) == 1 && (fd.revents & POLLIN)) {
    signalfd_siginfo info{};
    if (read(signal_fd, &info, sizeof info) != sizeof info) break;
    const int sig = static_cast<int>(info.ssi_signo);
    if (ignored_while_waiting(sig)) continue;
    if (sig == SIGTSTP) {
      stop_self();
    } else {
      signals.push_back(sig);
    }
  }
  return signals;
}

// Bad usage found before anything is touched; empty when the options are fine.
std::string usage_problem(const RunOptions& o) {
  const int chosen = !!o.lock + !!o.read + !!o.write + !!o.semaphore;
  if (chosen != 1) return "give exactly one of --lock, --read, --write, --semaphore";
  if (o.semaphore && !o.limit) return "--semaphore needs --limit N";
  if (!o.semaphore && o.limit) return "--limit goes only with --semaphore";
  if (o.limit && *o.limit < 1) return "--limit must be at least 1, got " + std::to_string(*o.limit);
  // Up to ~30 years: larger values would overflow the clocks' arithmetic.
  const auto bad_seconds = [](const std::optional<double>& value) {
    return value && !(std::isfinite(*value) && *value >= 0 && *value <= 1e9);
  };
  if (bad_seconds(o.timeout_sec)) return "--timeout must be a number of seconds, 0 to 1e9";
  if (bad_seconds(o.ttl_sec)) return "--ttl must be a number of seconds, 0 to 1e9";
  if (bad_seconds(std::optional<double>(o.grace_sec))) return "--grace must be a number of seconds, 0 to 1e9";
  if (o.command.empty()) return "no command to run: put it after '--'";
  return {};
}

// The child's environment: ours with TURNSTILE_FENCING_TOKEN and TURNSTILE_NAME set.
std::vector<std::string> child_environment(std::uint64_t token, const std::string& name) {
  std::vector<std::string> env;
  for (char** entry = environ; *entry; ++entry) {
    const std::string_view text(*entry);
    if (text.starts_with("TURNSTILE_FENCING_TOKEN=") || text.starts_with("TURNSTILE_NAME=")) continue;
    env.emplace_back(text);
  }
  env.push_back("TURNSTILE_FENCING_TOKEN=" + std::to_string(token));
  env.push_back("TURNSTILE_NAME=" + name);
  return env;
}

std::vector<char*> pointers(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// Kills the command's process group if turnstile dies, SIGKILL included (PR_SET_PDEATHSIG
// covers only the direct child). A process of its own: forked before the command, in a session
// of its own, so no signal sent to turnstile's group, the command's group or the terminal
// reaches it; it learns the group from the command itself, before exec, and then waits for
// end-of-file on a pipe that only turnstile writes to, which comes when turnstile exits.
// It keeps the descriptors it inherited (the embedded backend's locks among them) until the
// group is killed, so a contender woken by turnstile's death cannot start before that.
// Out of reach: processes that left the group (setsid, setpgid); only a cgroup could follow them.
class GroupWatcher {
 public:
  GroupWatcher() {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error(describe_errno("pipe"));
    // _Fork runs no atfork handlers: the child makes system calls only, as it must in a copy
    // of a process with library threads.
    pid_ = _Fork();
    if (pid_ < 0) {
      const int error = errno;
      close(fds[0]);
      close(fds[1]);
      errno = error;
      throw std::runtime_error(describe_errno("fork"));
    }
    if (pid_ == 0) watch(fds[0], fds[1]);
    close(fds[0]);
    write_fd_ = fds[1];
  }
  ~GroupWatcher() { dismiss(); }
  GroupWatcher(const GroupWatcher&) = delete;
  GroupWatcher& operator=(const GroupWatcher&) = delete;

  // Where the command writes its pid (= its group) before exec.
  int fd() const { return write_fd_; }
  // The group is gone (or turnstile ends normally): the watcher goes without killing anything.
  void dismiss() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      while (waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
      }
      pid_ = -1;
    }
    if (write_fd_ >= 0) close(write_fd_);
    write_fd_ = -1;
  }
  // A child turnstile reaped: if it was the watcher (killed by someone), forget its pid.
  void reaped(pid_t pid) {
    if (pid == pid_) pid_ = -1;
  }

 private:
  [[noreturn]] static void watch(int read_fd, int write_fd) {
    setsid();
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, nullptr);
    close(write_fd);
    for (int fd = 0; fd <= 2; ++fd) {
      if (fd != read_fd) close(fd);
    }
    pid_t group = 0;
    for (std::size_t got = 0; got < sizeof group;) {
      const ssize_t n = read(read_fd, reinterpret_cast<char*>(&group) + got, sizeof group - got);
      if (n == 0 || (n < 0 && errno != EINTR)) _exit(0);  // turnstile ended before running the command
      if (n > 0) got += static_cast<std::size_t>(n);
    }
    for (;;) {
      char byte;
      const ssize_t n = read(read_fd, &byte, 1);
      if (n == 0 || (n < 0 && errno != EINTR)) break;
    }
    if (group > 0) kill(-group, SIGKILL);
    _exit(0);
  }

  pid_t pid_ = -1;
  int write_fd_ = -1;
};

// In the vforked child: only async-signal-safe calls (the parent has library threads), and
// nothing that writes to memory the parent uses beyond errno (it shares our address space).
[[noreturn]] void exec_child(pid_t parent, const sigset_t& original_mask, char** argv, char** envp, int error_fd,
                             int watcher_fd, bool take_terminal) {
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
  // glibc's execvpe searches PATH without allocating, and runs scripts without #! via sh.
  execvpe(argv[0], argv, envp);
  const int error = errno;
  (void)!write(error_fd, &error, sizeof error);
  _exit(error == ENOENT || error == ENOTDIR ? kExitNotFound : kExitCannotExecute);
}

// vfork: the child shares our memory until it execs, so no page tables are copied and we
// take no copy-on-write faults afterwards (most of a fork's cost here). That is safe because
// exec_child only makes system calls on its own stack frame, and we are suspended meanwhile.
// A function of its own, so no variable of the caller lives across vfork.
__attribute__((noinline)) pid_t spawn(const sigset_t& original_mask, char** argv, char** envp, int error_fd,
                                      int watcher_fd, bool take_terminal) {
  const pid_t parent = getpid();
  const pid_t child = vfork();
  if (child == 0) exec_child(parent, original_mask, argv, envp, error_fd, watcher_fd, take_terminal);
  return child;
}

int status_of(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return kExitOsError;
}

// Releases a hold known to be lost, waiting at most `bound`: what a cut-off connection cannot
// remove, the server's expiry will, and turnstile must not hang on it. The caller _exits next.
void release_within(Hold& hold, std::chrono::milliseconds bound) {
  struct Done {
    std::mutex mutex;
    std::condition_variable changed;
    bool done = false;
  };
  auto done = std::make_shared<Done>();
  std::thread([&hold, done] {
    try {
      hold.release();
    } catch (...) {
      // Lost, or unreachable: either way, nothing more to do here.
    }
    std::lock_guard lock(done->mutex);
    done->done = true;
    done->changed.notify_all();
  }).detach();
  std::unique_lock lock(done->mutex);
  done->changed.wait_for(lock, bound, [&] { return done->done; });
}

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
  bool paused() const { return paused_; }
  // The command is done: the terminal goes back to our group if the command's group has it.
  void restore_terminal() {
    if (interactive_ && tcgetpgrp(STDIN_FILENO) == leader_) tcsetpgrp(STDIN_FILENO, getpgrp());
  }

 private:
  pid_t leader_;
  bool interactive_;
  bool paused_ = false;
};

// Runs the command under the hold; returns turnstile's exit status, or _exits with it when the
// hold was lost (no clean-up may wait on the network then). Releases the hold.
int supervise(Hold& hold, const std::string& name, const RunOptions& options, int signal_fd,
              const sigset_t& original_mask, const std::vector<int>& early_signals, StateChanges& changes) {
  int lost_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (lost_fd < 0) throw std::runtime_error(describe_errno("eventfd"));
  // Runs on the library's watcher thread (or right here if already lost): just wake the loop.
  // Optional so it can be unregistered before lost_fd is closed.
  const auto wake = [lost_fd] {
    const std::uint64_t one = 1;
    (void)!write(lost_fd, &one, sizeof one);
  };
  std::optional<std::stop_callback<decltype(wake)>> on_loss(std::in_place, hold.lost, wake);

  auto argv_strings = options.command;
  auto env_strings = child_environment(hold.token, name);
  auto argv = pointers(argv_strings);
  auto envp = pointers(env_strings);

  // Our descendants that lose their parent come to us, so leftovers of the command's group are
  // reaped here and the group empties.
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  GroupWatcher watcher;
  const bool interactive = isatty(STDIN_FILENO) && tcgetsid(STDIN_FILENO) == getsid(0);
  const bool take_terminal = interactive && tcgetpgrp(STDIN_FILENO) == getpgrp();

  int error_pipe[2];
  if (pipe2(error_pipe, O_CLOEXEC) != 0) throw std::runtime_error(describe_errno("pipe"));
  std::fflush(nullptr);
  const pid_t child = spawn(original_mask, argv.data(), envp.data(), error_pipe[1], watcher.fd(), take_terminal);
  if (child < 0) throw std::runtime_error(describe_errno("vfork"));
  close(error_pipe[1]);
  CommandGroup group(child, interactive);

  // EOF means exec succeeded (the pipe closed on exec); an int is the child's exec errno.
  int exec_errno = 0;
  ssize_t got;
  do {
    got = read(error_pipe[0], &exec_errno, sizeof exec_errno);
  } while (got < 0 && errno == EINTR);
  close(error_pipe[0]);

  for (int sig : early_signals) group.signal(sig);

  using Clock = std::chrono::steady_clock;
  const auto grace = std::chrono::ceil<Clock::duration>(std::chrono::duration<double>(options.grace_sec));
  bool lost = false;
  bool suspended = false;
  bool leader_exited = false;
  int wait_status = 0;
  std::optional<Clock::time_point> kill_at;     // SIGKILL the group then
  std::optional<Clock::time_point> give_up_at;  // stop waiting for the group to empty then
  // SIGTERM to the whole group now (continued if paused, so it can act on it), SIGKILL after
  // the grace period.
  const auto terminate_group = [&] {
    group.signal(SIGTERM);
    if (group.paused()) group.unpause();
    if (!kill_at && !give_up_at) kill_at = Clock::now() + grace;
  };
  for (;;) {
    // The leader's exit or job-control stop; orphans of the group (we are their subreaper).
    for (;;) {
      int status = 0;
      const pid_t pid = waitpid(-1, &status, WNOHANG | WUNTRACED);
      if (pid <= 0) break;
      if (pid != child) {
        watcher.reaped(pid);
      } else if (!WIFSTOPPED(status)) {
        leader_exited = true;
        wait_status = status;
      } else if (const int sig = WSTOPSIG(status); sig == SIGTSTP || sig == SIGTTIN || sig == SIGTTOU) {
        group.stopped();
      }
    }
    const auto now = Clock::now();
    if (kill_at && now >= *kill_at) {
      group.signal(SIGKILL);
      kill_at.reset();
      give_up_at = now + std::chrono::seconds(1);  // for members that die as zombies others must reap
    }
    if (leader_exited) {
      if (!group.alive() || (give_up_at && now >= *give_up_at)) break;
      if (!kill_at && !give_up_at) {
        if (!lost) complain("the command exited but left processes in its process group; stopping them");
        terminate_group();
      }
    }

    // Leftovers may exit without telling us (their parent reaps them): look again soon.
    int timeout_ms = leader_exited ? 20 : -1;
    for (const auto& at : {kill_at, give_up_at}) {
      if (!at) continue;
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(*at - now).count();
      const int ms = static_cast<int>(std::clamp<std::int64_t>(left, 0, 60'000));
      timeout_ms = timeout_ms < 0 ? ms : std::min(timeout_ms, ms);
    }
    pollfd fds[3] = {{signal_fd, POLLIN, 0}, {lost_fd, POLLIN, 0}, {changes.fd(), POLLIN, 0}};
    if (poll(fds, 3, timeout_ms) < 0 && errno != EINTR) throw std::runtime_error(describe_errno("poll"));
    if (fds[2].revents & POLLIN) {
      // Always taken (else poll would spin); a lost hold is past suspending.
      const auto [state, reason] = changes.take();
      if (!lost && state == HoldState::suspended && !suspended) {
        suspended = true;
        complain("the hold on '" + name + "' is suspended (" + reason + "); " +
                 (options.pause_when_suspended ? "pausing the command until it is confirmed"
                                               : "the command keeps running meanwhile"));
        if (options.pause_when_suspended) group.pause();
      } else if (!lost && state == HoldState::held && suspended) {
        suspended = false;
        complain("the hold on '" + name + "' is confirmed again" +
                 (options.pause_when_suspended ? "; resuming the command" : ""));
        if (options.pause_when_suspended) group.unpause();
      }
    }
    if (fds[0].revents & POLLIN) {
      signalfd_siginfo info{};
      if (read(signal_fd, &info, sizeof info) == sizeof info) {
        const int sig = static_cast<int>(info.ssi_signo);
        if (sig == SIGCONT) {
          group.continue_group();
        } else if (sig != SIGCHLD && sig != SIGTTIN && sig != SIGTTOU) {
          // The group gets nothing sent to turnstile's group or to turnstile directly, so this
          // delivers each signal exactly once. A forwarded SIGTSTP stops the command, whose stop
          // then stops turnstile.
          group.signal(sig);
        }
      }
    }
    if ((fds[1].revents & POLLIN) && !lost) {
      lost = true;
      complain("the hold on '" + name + "' (fencing token " + std::to_string(hold.token) +
               ") may have been lost; stopping the command");
      terminate_group();
    }
  }
  group.restore_terminal();
  watcher.dismiss();

  int status = status_of(wait_status);
  if (exec_errno != 0) {
    const bool not_found = exec_errno == ENOENT || exec_errno == ENOTDIR;
    complain("cannot run '" + options.command.front() + "': " +
             (not_found ? std::string("command not found") : std::strerror(exec_errno)));
    status = not_found ? kExitNotFound : kExitCannotExecute;
  }
  if (!lost) {
    try {
      hold.release();
    } catch (const HoldLost& error) {
      // Lost before the release, perhaps while the command ran: it may have run unprotected.
      complain(error.what());
      lost = true;
    } catch (const Error& error) {
      complain(std::string("releasing the hold failed: ") + error.what());
    }
    if (!lost) {
      on_loss.reset();  // waits for a callback running right now
      close(lost_fd);
      return status;
    }
  } else {
    release_within(hold, std::chrono::seconds(1));
  }
  // Lost: exit now. The client's clean-up could wait on a connection that is gone; the server's
  // expiry removes whatever is left.
  std::fflush(nullptr);
  _exit(exec_errno != 0 ? status : kExitHoldLost);
}

}  // namespace

int run_command(const RunOptions& options) {
  if (const auto problem = usage_problem(options); !problem.empty()) {
    complain(problem);
    return kExitUsage;
  }
  const Kind kind = options.lock ? Kind::lock : options.read ? Kind::read : options.write ? Kind::write : Kind::semaphore;
  const std::string name = options.lock ? *options.lock
                           : options.read ? *options.read
                           : options.write ? *options.write
                                           : *options.semaphore;

  // Block before any thread exists so that every thread inherits the mask and the signals
  // wait in the signalfd; the child gets the original mask back before exec.
  sigset_t handled, original_mask;
  sigemptyset(&handled);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD, SIGTSTP, SIGCONT, SIGTTIN, SIGTTOU}) {
    sigaddset(&handled, sig);
  }
  pthread_sigmask(SIG_BLOCK, &handled, &original_mask);
  const int signal_fd = signalfd(-1, &handled, SFD_CLOEXEC);
  if (signal_fd < 0) {
    complain(describe_errno("signalfd"));
    return kExitOsError;
  }

  try {
    StateChanges changes;
    ClientOptions client_options;
    client_options.on_hold_state = [&changes](const HoldStateChange& change) { changes.record(change); };
    if (options.ttl_sec) {
      client_options.ttl = std::chrono::ceil<std::chrono::milliseconds>(std::chrono::duration<double>(*options.ttl_sec));
    }
    auto client = connect_backend(options.backend, std::move(client_options));

    // The deadline counts from before the first try.
    Wait wait = kTryOnce;
    if (!options.timeout_sec) {
      wait.emplace(std::nullopt);
    } else if (*options.timeout_sec > 0) {
      wait.emplace(std::chrono::steady_clock::now() +
                   std::chrono::ceil<std::chrono::steady_clock::duration>(std::chrono::duration<double>(*options.timeout_sec)));
    }
    // Try once first: uncontended, that is the whole acquisition, and it needs no thread.
    auto hold = acquire(client, kind, name, options, kTryOnce);
    std::vector<int> early_signals;
    if (hold) {
      early_signals = pending_signals(signal_fd);
    } else if (wait) {
      AcquisitionGuard guard(signal_fd, name);
      hold = acquire(client, kind, name, options, wait, guard.token());
      auto outcome = guard.disarm();
      early_signals = std::move(outcome.pending);
      if (outcome.cancelled_by != 0) {
        // Taken just as the signal came: give it back, the command was not started.
        if (hold) {
          try {
            hold->release();
          } catch (const Error&) {
            // Nothing ran under it; the backend's expiry or retry cleans up.
          }
        }
        complain(std::string(strsignal(outcome.cancelled_by)) + " while waiting for '" + name +
                 "'; left the queue, the command was not run");
        return 128 + outcome.cancelled_by;
      }
    }
    if (!hold) {
      if (*options.timeout_sec == 0) {
        complain("'" + name + "' is busy");
      } else {
        char seconds[32];
        std::snprintf(seconds, sizeof seconds, "%g", *options.timeout_sec);
        complain("timed out after " + std::string(seconds) + " s waiting for '" + name + "'");
      }
      return kExitTimeout;
    }
    return supervise(*hold, name, options, signal_fd, original_mask, early_signals, changes);
  } catch (const Error& error) {
    complain(error.what());
    return exit_status_for(error);
  } catch (const std::exception& error) {
    complain(error.what());
    return kExitOsError;
  }
}

}  // namespace turnstile::cli
