// `turnstile run`: hold a lock or semaphore while a child command runs.
//
// Signals: SIGINT/SIGTERM/SIGHUP/SIGCHLD are blocked before any thread exists (so no library
// thread ever takes them) and read from a signalfd. While we wait for the hold, a small thread
// reads it and makes us exit at once; once we hold, the main thread forwards them to the child.
// An uncontended hold is taken by one try first, without that thread (a try cannot block).
// The main thread forks and stays alive until the child is reaped, because PR_SET_PDEATHSIG
// fires when the forking *thread* exits.
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
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

// The signal watcher during acquisition: a signal makes turnstile exit (128 + signal) without
// running the command. Once the hold is taken, `disarm()` stops it; signals it read after
// the hold was taken are handed back for forwarding to the child.
class AcquisitionGuard {
 public:
  AcquisitionGuard(int signal_fd, std::string name) : signal_fd_(signal_fd), name_(std::move(name)) {
    stop_fd_ = eventfd(0, EFD_CLOEXEC);
    if (stop_fd_ < 0) throw std::runtime_error(describe_errno("eventfd"));
    thread_ = std::thread([this] { watch(); });
  }
  ~AcquisitionGuard() { disarm(); }

  std::vector<int> disarm() {
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
    return std::move(pending_);
  }

 private:
  void watch() {
    pollfd fds[2] = {{signal_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    for (;;) {
      if (poll(fds, 2, -1) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (fds[1].revents) return;
      signalfd_siginfo info{};
      if (read(signal_fd_, &info, sizeof info) != sizeof info) continue;
      const int sig = static_cast<int>(info.ssi_signo);
      if (sig == SIGCHLD) continue;  // no child yet
      std::lock_guard lock(mutex_);
      if (acquired_) {
        pending_.push_back(sig);
        return;
      }
      // The library gives no way to cancel a blocked acquisition; exiting drops our queue
      // entry exactly as a crash would (the kernel releases its locks).
      std::fprintf(stderr, "turnstile: %s while waiting for '%s'; the command was not run\n", strsignal(sig),
                   name_.c_str());
      std::fflush(stderr);
      _exit(128 + sig);
    }
  }

  int signal_fd_;
  int stop_fd_ = -1;
  std::string name_;
  std::mutex mutex_;
  bool acquired_ = false;
  std::vector<int> pending_;
  std::thread thread_;
};

// How long acquire() may wait: nothing (one try), until a deadline, or forever.
using Wait = std::optional<std::optional<std::chrono::steady_clock::time_point>>;
constexpr Wait kTryOnce = std::nullopt;

// Takes the hold; nullopt when the wait ended first.
std::optional<Hold> acquire(Client& client, Kind kind, const std::string& name, const RunOptions& options,
                            const Wait& wait) {
  const bool once = !wait.has_value();
  const bool forever = wait.has_value() && !wait->has_value();
  switch (kind) {
    case Kind::lock: {
      auto mutex = std::make_shared<Mutex>(client.mutex(name));
      const bool got = once ? mutex->try_lock() : forever ? (mutex->lock(), true) : mutex->try_lock_until(**wait);
      if (!got) return std::nullopt;
      return Hold{mutex->fencing_token(), mutex->lost_token(), [mutex] { mutex->release(); }};
    }
    case Kind::read:
    case Kind::write: {
      auto rw = std::make_shared<SharedMutex>(client.shared_mutex(name));
      bool got;
      if (kind == Kind::read) {
        got = once ? rw->try_lock_shared() : forever ? (rw->lock_shared(), true) : rw->try_lock_shared_until(**wait);
      } else {
        got = once ? rw->try_lock() : forever ? (rw->lock(), true) : rw->try_lock_until(**wait);
      }
      if (!got) return std::nullopt;
      auto release = kind == Kind::read ? std::function<void()>([rw] { rw->release_shared(); })
                                        : std::function<void()>([rw] { rw->release(); });
      return Hold{rw->fencing_token(), rw->lost_token(), std::move(release)};
    }
    case Kind::semaphore: {
      auto semaphore = client.semaphore(name, *options.limit);
      std::optional<Lease> lease = once      ? semaphore.try_acquire()
                                   : forever ? std::optional<Lease>(semaphore.acquire())
                                             : semaphore.try_acquire_until(**wait);
      if (!lease) return std::nullopt;
      auto shared = std::make_shared<Lease>(std::move(*lease));
      return Hold{shared->fencing_token(), shared->lost_token(), [shared] { shared->release(); }};
    }
  }
  return std::nullopt;
}

// Signals that came while the hold was being tried, without the guard thread: each is handed
// to the child, as the guard does with signals it reads once the hold is taken.
std::vector<int> pending_signals(int signal_fd) {
  std::vector<int> signals;
  pollfd fd{signal_fd, POLLIN, 0};
  while (poll(&fd, 1, 0) == 1 && (fd.revents & POLLIN)) {
    signalfd_siginfo info{};
    if (read(signal_fd, &info, sizeof info) != sizeof info) break;
    if (info.ssi_signo != SIGCHLD) signals.push_back(static_cast<int>(info.ssi_signo));
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

// In the vforked child: only async-signal-safe calls (the parent has library threads), and
// nothing that writes to memory the parent uses beyond errno (it shares our address space).
[[noreturn]] void exec_child(pid_t parent, const sigset_t& original_mask, char** argv, char** envp, int error_fd) {
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

int status_of(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return kExitOsError;
}

// Runs the child under the hold; returns turnstile's exit status. Releases the hold.
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
  int error_pipe[2];
  if (pipe2(error_pipe, O_CLOEXEC) != 0) throw std::runtime_error(describe_errno("pipe"));

  std::fflush(nullptr);
  const pid_t parent = getpid();
  // vfork: the child shares our memory until it execs, so no page tables are copied and we
  // take no copy-on-write faults afterwards (most of a fork's cost here). That is safe because
  // exec_child only makes system calls on its own stack frame, and we are suspended meanwhile.
  const pid_t child = vfork();
  if (child < 0) throw std::runtime_error(describe_errno("vfork"));
  if (child == 0) exec_child(parent, original_mask, argv.data(), envp.data(), error_pipe[1]);
  close(error_pipe[1]);

  // EOF means exec succeeded (the pipe closed on exec); an int is the child's exec errno.
  int exec_errno = 0;
  ssize_t got;
  do {
    got = read(error_pipe[0], &exec_errno, sizeof exec_errno);
  } while (got < 0 && errno == EINTR);
  close(error_pipe[0]);

  for (int sig : early_signals) kill(child, sig);

  bool lost = false;
  bool suspended = false;
  std::optional<std::chrono::steady_clock::time_point> kill_at;
  int wait_status = 0;
  for (bool reaped = false; !reaped;) {
    int timeout_ms = -1;
    if (kill_at) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(*kill_at - std::chrono::steady_clock::now());
      timeout_ms = static_cast<int>(std::max<std::int64_t>(0, left.count()));
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
        if (options.pause_when_suspended) kill(child, SIGSTOP);
      } else if (!lost && state == HoldState::held && suspended) {
        suspended = false;
        complain("the hold on '" + name + "' is confirmed again" +
                 (options.pause_when_suspended ? "; resuming the command" : ""));
        if (options.pause_when_suspended) kill(child, SIGCONT);
      }
    }
    if (fds[0].revents & POLLIN) {
      signalfd_siginfo info{};
      if (read(signal_fd, &info, sizeof info) == sizeof info) {
        const int sig = static_cast<int>(info.ssi_signo);
        if (sig == SIGCHLD) {
          if (waitpid(child, &wait_status, WNOHANG) == child) reaped = true;
        } else if (info.ssi_code != SI_KERNEL) {
          // A signal from the terminal (SI_KERNEL) already went to the whole foreground
          // process group, the child included: forwarding it would deliver it twice.
          kill(child, sig);
        }
      }
    }
    if ((fds[1].revents & POLLIN) && !lost) {
      lost = true;
      complain("the hold on '" + name + "' (fencing token " + std::to_string(hold.token) +
               ") may have been lost; stopping the command");
      kill(child, SIGTERM);
      if (suspended && options.pause_when_suspended) kill(child, SIGCONT);  // so it can act on SIGTERM
      kill_at = std::chrono::steady_clock::now() +
                std::chrono::ceil<std::chrono::steady_clock::duration>(std::chrono::duration<double>(options.grace_sec));
    }
    if (!reaped && kill_at && std::chrono::steady_clock::now() >= *kill_at) {
      kill(child, SIGKILL);
      kill_at.reset();
    }
  }

  try {
    hold.release();
  } catch (const HoldLost& error) {
    // Lost before the release, perhaps while the command ran: it may have run unprotected.
    if (!lost) complain(error.what());
    lost = true;
  } catch (const Error& error) {
    complain(std::string("releasing the hold failed: ") + error.what());
  }
  on_loss.reset();  // waits for a callback running right now
  close(lost_fd);

  if (exec_errno != 0) {
    const bool not_found = exec_errno == ENOENT || exec_errno == ENOTDIR;
    complain("cannot run '" + options.command.front() + "': " +
             (not_found ? std::string("command not found") : std::strerror(exec_errno)));
    return not_found ? kExitNotFound : kExitCannotExecute;
  }
  if (lost) return kExitHoldLost;
  return status_of(wait_status);
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
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) sigaddset(&handled, sig);
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
      hold = acquire(client, kind, name, options, wait);
      early_signals = guard.disarm();
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
