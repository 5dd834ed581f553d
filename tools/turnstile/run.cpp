// `turnstile run`: hold a lock or semaphore while a command runs.
//
// Signals: SIGINT/SIGTERM/SIGHUP/SIGQUIT, SIGCHLD and the job-control signals are blocked before
// any thread exists (so no library thread ever takes them) and read from a signalfd. Until the
// command starts, such a signal means it will not run: while we wait for the hold, a small
// thread reads them and cancels the wait, which leaves the queue; a hold taken meanwhile is
// given back. Once the command runs, the main thread forwards them to its process group.
// An uncontended hold is taken by one try first; on file:// without that thread (the try is
// quick, and signals that came meanwhile are read right after it).
//
// The command runs in a process group of its own, so what is sent to turnstile's group (Ctrl-C
// without a terminal, `timeout`, `kill -INT -PGID`) reaches it once, through us; loss, forwarded
// signals and --pause-when-suspended act on the whole group. In the foreground of a terminal
// the command's group gets the terminal, and its job-control stops are passed on to the shell
// by stopping turnstile too. A watcher process kills the group if turnstile dies, SIGKILL
// included, and stops it while turnstile is stopped (nobody renews the hold then). The main thread forks and stays alive until the command is reaped, because
// PR_SET_PDEATHSIG fires when the forking *thread* exits.
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
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
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string_view>
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

// How long turnstile lets the group go on after the hold may have been lost, and what it then
// gives the release.
struct LossBounds {
  std::chrono::steady_clock::duration kill_after;  // SIGTERM, then SIGKILL this much later
  // After the group is gone or got SIGKILL: what is left for reaping it and the release.
  static constexpr auto kCleanUp = std::chrono::seconds(1);
};

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
    if (change.state == HoldState::lost) {
      // The loss itself comes through the stop token; this says how long is left.
      std::lock_guard lock(mutex_);
      loss_margin_ = change.margin;
      loss_cv_.notify_all();
      return;
    }
    {
      std::lock_guard lock(mutex_);
      state_ = change.state;
      reason_ = change.reason;
    }
    const std::uint64_t one = 1;
    (void)!write(fd_, &one, sizeof one);
  }
  int fd() const { return fd_; }
  // The library's margin for a loss (how long before the server could hand the hold to someone
  // else), told right after the stop token; nullopt when it did not come within `wait`.
  std::optional<std::chrono::milliseconds> loss_margin(std::chrono::milliseconds wait) {
    std::unique_lock lock(mutex_);
    loss_cv_.wait_for(lock, wait, [this] { return loss_margin_.has_value(); });
    return loss_margin_;
  }
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
  std::condition_variable loss_cv_;
  std::optional<std::chrono::milliseconds> loss_margin_;
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

// The signal watcher during acquisition: a signal cancels the acquisition (through the stop
// token: a waiter leaves the queue first, so on a network backend nobody waits for its expiry),
// and turnstile then exits 128 + signal without running the command, giving back a hold taken
// meanwhile. A second signal while the wait is being left exits at once, and so does the first
// when leaving takes too long. `disarm()` stops it once the acquisition has returned; signals
// that come later are read by the caller (see cancelling_signal).
class AcquisitionGuard {
 public:
  AcquisitionGuard(int signal_fd, std::string name) : signal_fd_(signal_fd), name_(std::move(name)) {
    stop_fd_ = eventfd(0, EFD_CLOEXEC);
    if (stop_fd_ < 0) throw std::runtime_error(describe_errno("eventfd"));
    thread_ = std::thread([this] { watch(); });
  }
  ~AcquisitionGuard() { disarm(); }
  AcquisitionGuard(const AcquisitionGuard&) = delete;
  AcquisitionGuard& operator=(const AcquisitionGuard&) = delete;

  std::stop_token token() const { return stop_.get_token(); }

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
      if (cancelled_by_ != 0) {
        std::fprintf(stderr, "turnstile: %s again; exiting without waiting to leave the queue\n", strsignal(sig));
        _exit(128 + sig);
      }
      cancelled_by_ = sig;
      stop_.request_stop();
      exit_at = std::chrono::steady_clock::now() + kLeaveBound;
    }
  }

  // How long a cancelled acquisition may take to return.
  static constexpr auto kLeaveBound = std::chrono::seconds(2);

  int signal_fd_;
  int stop_fd_ = -1;
  std::string name_;
  std::stop_source stop_;
  std::mutex mutex_;
  int cancelled_by_ = 0;
  std::thread thread_;
};

// How long acquire() may wait: nothing (one try), until a deadline, or forever.
using Wait = std::optional<std::optional<std::chrono::steady_clock::time_point>>;
constexpr Wait kTryOnce = std::nullopt;
// With --timeout 0 and no --connect-timeout: how long connecting may take (a try-once acquire
// gets about as long to reach the server).
constexpr auto kTryOnceConnect = std::chrono::seconds(1);

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

// The first signal, among those nobody has read yet, that cancels an acquisition (0 if none):
// they came before the command started, so it will not run. Job-control stops apply meanwhile.
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

// The TTL of the holds when turnstile knows it: --ttl, else the URL's ?ttl= (ZooKeeper:
// ?session_timeout=). Otherwise the backend's default applies, which turnstile cannot see.
std::optional<std::chrono::milliseconds> known_ttl(const RunOptions& options, std::string_view url) {
  const auto milliseconds = [](double seconds) {
    return std::chrono::ceil<std::chrono::milliseconds>(std::chrono::duration<double>(seconds));
  };
  if (options.ttl_sec && *options.ttl_sec > 0) return milliseconds(*options.ttl_sec);  // 0: the URL's or default
  if (url.starts_with("file:")) return std::nullopt;
  const auto q = url.find('?');
  if (q == std::string_view::npos) return std::nullopt;
  for (auto query = url.substr(q + 1); !query.empty();) {
    const auto amp = query.find_first_of("&#");
    const auto pair = query.substr(0, amp);
    query = amp == std::string_view::npos || query[amp] == '#' ? std::string_view{} : query.substr(amp + 1);
    const auto eq = pair.find('=');
    if (eq == std::string_view::npos || (pair.substr(0, eq) != "ttl" && pair.substr(0, eq) != "session_timeout")) continue;
    const std::string value(pair.substr(eq + 1));
    char* end = nullptr;
    const double seconds = std::strtod(value.c_str(), &end);
    // The library accepted the URL; anything else here is a form this parse does not know.
    if (end == value.c_str() + value.size() && std::isfinite(seconds) && seconds > 0 && seconds <= 1e9) {
      return milliseconds(seconds);
    }
  }
  return std::nullopt;
}

// On loss, SIGKILL follows SIGTERM after --grace, but never later than half the safety margin
// by which the loss is reported before the server can hand the hold to someone else (the other
// half is left for the kill itself and the clocks' drift). The library tells that margin with
// the loss (HoldStateChange::margin, the granted TTL's); this bound from the TTL turnstile knows,
// max(TTL/10, 50 ms), is the fallback should it not arrive. Without a known TTL: half the margin
// of the shortest default TTL (etcd's 10 s).
LossBounds loss_bounds(const RunOptions& options, std::string_view url) {
  using namespace std::chrono_literals;
  const auto ttl = known_ttl(options, url);
  const std::chrono::milliseconds margin = ttl ? std::max<std::chrono::milliseconds>(*ttl / 10, 50ms) : 1000ms;
  return {margin / 2};
}

// The name given with --lock, --read, --write or --semaphore.
const std::string& hold_name(const RunOptions& o) {
  return o.lock ? *o.lock : o.read ? *o.read : o.write ? *o.write : *o.semaphore;
}

// Bad usage found before anything is touched; empty when the options are fine. `run` needs a
// command; `hold` takes none.
std::string usage_problem(const RunOptions& o, bool needs_command) {
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
  if (!(std::isfinite(o.connect_timeout_sec) && o.connect_timeout_sec > 0 && o.connect_timeout_sec <= 1e9)) {
    return "--connect-timeout must be a number of seconds, more than 0 and at most 1e9";
  }
  if (o.conflict_exit_code && (*o.conflict_exit_code < 0 || *o.conflict_exit_code > 255)) {
    return "--conflict-exit-code must be 0 to 255, got " + std::to_string(*o.conflict_exit_code);
  }
  if (!needs_command) return {};
  if (o.shell && !o.command.empty()) return "give either -c 'COMMAND LINE' or a COMMAND after '--', not both";
  if (o.shell && o.shell->empty()) return "-c needs a command line";
  if (!o.shell && o.command.empty()) return "no command to run: put it after '--' (or give -c 'COMMAND LINE')";
  return {};
}

// One holder as messages name it: its label, pid@host and since when, or the foreign client.
std::string holder_text(const EntryInfo& holder) {
  if (!holder.foreign.empty()) return printable(holder.foreign);
  std::string text;
  if (!holder.label.empty()) text += "\"" + printable(holder.label) + "\" ";
  // What a backend does not know (pid 0, the epoch) is left out rather than made up.
  if (holder.pid != 0) {
    text += "pid " + std::to_string(holder.pid) + "@" + printable(holder.host);
  } else if (!holder.host.empty()) {
    text += printable(holder.host);
  } else if (holder.label.empty()) {
    text += "an unidentified holder";
  }
  if (holder.since.time_since_epoch().count() != 0) text += " since " + iso8601(holder.since);
  while (text.ends_with(' ')) text.pop_back();
  return text;
}

// Who is in the queue of a name, as far as inspect tells; `known` is false when it failed
// (a message about the queue must not fail for it).
struct QueueView {
  bool known = false;
  std::string holder;  // holder_text of the first holder, "" when none
  std::size_t holders = 0, waiters = 0;
  // An entry carries this process's pid (turnstile makes one acquisition per process): after a
  // cancelled wait, its leaving has not been confirmed.
  bool has_ours = false;
};
// A look for messages only: it never holds turnstile up for long, whatever the server does (a
// look the server does not answer in time just names nobody).
constexpr auto kLookPatience = std::chrono::milliseconds(500);

QueueView look_at_queue(Client& client, const std::string& name) {
  try {
    const auto inspection = client.inspect(name, SteadyClock::now() + kLookPatience);
    QueueView view{true, {}, inspection.holders.size(), inspection.waiters.size()};
    if (!inspection.holders.empty()) view.holder = holder_text(inspection.holders.front());
    const auto ours = [self = static_cast<std::int64_t>(getpid())](const EntryInfo& entry) { return entry.pid == self; };
    view.has_ours = std::any_of(inspection.holders.begin(), inspection.holders.end(), ours) ||
                    std::any_of(inspection.waiters.begin(), inspection.waiters.end(), ours);
    return view;
  } catch (const Error&) {
    return {};
  }
}

// After a signal cancelled the acquisition: releases a hold taken meanwhile, and says what became
// of it or of the entry the cancelled wait left. Only what the server confirmed is told as done:
// a leave or a release is a network call that may go unanswered (then retried in the
// background, or ended by the entry's TTL or the session's end).
std::string give_back_after_signal(Client& client, const std::string& name, std::optional<Hold>& hold) {
  const auto unconfirmed = " (it may not have finished: an entry left behind ends with this client's session or TTL)";
  if (hold) {
    try {
      hold->release();
      return "released '" + name + "'";
    } catch (const Error& error) {
      return "could not confirm the release of '" + name + "': " + error.what() + unconfirmed;  // nothing ran under it
    }
  }
  const auto queue = look_at_queue(client, name);
  if (queue.known && !queue.has_ours) return "left the queue of '" + name + "'";
  return "could not confirm leaving the queue of '" + name + "'" + unconfirmed;
}

// "; held by LABEL pid@host since TIME (and N more)", or "" when no holder is known.
std::string held_by(const QueueView& view) {
  if (view.holder.empty()) return {};
  std::string text = "; held by " + view.holder;
  if (view.holders > 1) text += " (and " + std::to_string(view.holders - 1) + " more)";
  return text;
}

// What a hold is called in messages: "the lock 'jobs/nightly'", "a lease of the semaphore ...".
std::string what_is_held(Kind kind, const std::string& name, const RunOptions& options) {
  const auto quoted = "'" + printable(name) + "'";
  switch (kind) {
    case Kind::lock: return "the lock " + quoted;
    case Kind::read: return "the read side of " + quoted;
    case Kind::write: return "the write side of " + quoted;
    case Kind::semaphore: return "a lease of the semaphore " + quoted + " (limit " + std::to_string(*options.limit) + ")";
  }
  return quoted;
}

std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", seconds);
  return text;
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

  GroupWatcher() {
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
  ~GroupWatcher() { dismiss(); }
  GroupWatcher(const GroupWatcher&) = delete;
  GroupWatcher& operator=(const GroupWatcher&) = delete;

  // Where the command writes its pid (= its group) before exec.
  int fd() const { return write_fd_; }
  // Readable when the watcher stopped the group because turnstile was stopped.
  int stopped_fd() const { return stopped_fd_; }
  // Clears stopped_fd(); true if the watcher had stopped the group.
  bool take_stopped() {
    char bytes[64];
    bool any = false;
    while (stopped_fd_ >= 0 && read(stopped_fd_, bytes, sizeof bytes) > 0) any = true;
    return any;
  }
  // The group is gone (or turnstile ends normally): the watcher goes without killing anything.
  void dismiss() {
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
  // A child turnstile reaped: if it was the watcher (killed by someone), forget its pid.
  void reaped(pid_t pid) {
    if (pid == pid_) pid_ = -1;
  }

 private:
  // Whether the process whose /proc/PID/stat is open on `stat_fd` (turnstile) is stopped by a
  // signal ('T'; not 't', a tracer's stop, which comes and goes with every traced system call).
  static bool stopped(int stat_fd) {
    char text[512];
    const ssize_t n = pread(stat_fd, text, sizeof text, 0);
    for (ssize_t i = n - 1; i > 0; --i) {  // "PID (COMM) STATE ...": COMM may hold ") "
      if (text[i] == ')') return i + 2 < n && text[i + 2] == 'T';
    }
    return false;
  }

  [[noreturn]] static void watch(int stat_fd, int read_fd, int stopped_fd) {
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

  pid_t pid_ = -1;
  int write_fd_ = -1;
  int stopped_fd_ = -1;
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
void release_within(Hold& hold, std::chrono::steady_clock::duration bound) {
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
  // The command is done: the terminal goes back to our group if the command's group has it.
  void restore_terminal() {
    if (interactive_ && tcgetpgrp(STDIN_FILENO) == leader_) tcsetpgrp(STDIN_FILENO, getpgrp());
  }

 private:
  pid_t leader_;
  bool interactive_;
  bool paused_ = false;
};

// After turnstile is continued (fg, SIGCONT after a SIGSTOP), the group is continued this much
// later: time for the library's loss clock, which ran out while turnstile was stopped, to report
// the loss first, so that a command whose hold expired meanwhile is stopped, not continued.
constexpr auto kSettleAfterContinue = std::chrono::milliseconds(100);

// Runs the command under the hold; returns turnstile's exit status, or _exits with it when the
// hold was lost (no clean-up may wait on the network then). Releases the hold.
int supervise(Hold& hold, const std::string& name, const std::string& what, const RunOptions& options, int signal_fd,
              const sigset_t& original_mask, const LossBounds& loss, StateChanges& changes) {
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

  using Clock = std::chrono::steady_clock;
  const auto grace = std::chrono::ceil<Clock::duration>(std::chrono::duration<double>(options.grace_sec));
  bool lost = false;
  bool suspended = false;
  bool leader_exited = false;
  int wait_status = 0;
  std::optional<Clock::time_point> kill_at;       // SIGKILL the group then
  std::optional<Clock::time_point> killed_at;     // when it got SIGKILL
  std::optional<Clock::time_point> give_up_at;    // stop waiting for the group to empty then
  std::optional<Clock::time_point> continue_at;   // continue the group then (see kSettleAfterContinue)
  // SIGTERM to the whole group now (continued, so it can act on it), SIGKILL after `after`.
  const auto terminate_group = [&](Clock::duration after) {
    group.signal(SIGTERM);
    group.unpause();
    continue_at.reset();
    const auto at = Clock::now() + after;
    if (!killed_at && (!kill_at || at < *kill_at)) kill_at = at;
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
      killed_at = now;
      give_up_at = now + LossBounds::kCleanUp;  // for members that die as zombies others must reap
    }
    if (continue_at && now >= *continue_at) {
      continue_at.reset();
      if (!lost) group.continue_group();
    }
    if (leader_exited) {
      if (!group.alive() || (give_up_at && now >= *give_up_at)) break;
      if (!kill_at && !killed_at) {
        if (!lost) complain("the command exited but left processes in its process group; stopping them");
        terminate_group(grace);
      }
    }

    // Leftovers may exit without telling us (their parent reaps them): look again soon.
    int timeout_ms = leader_exited ? 20 : -1;
    for (const auto& at : {kill_at, give_up_at, continue_at}) {
      if (!at) continue;
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(*at - now).count();
      const int ms = static_cast<int>(std::clamp<std::int64_t>(left, 0, 60'000));
      timeout_ms = timeout_ms < 0 ? ms : std::min(timeout_ms, ms);
    }
    pollfd fds[4] = {{signal_fd, POLLIN, 0}, {lost_fd, POLLIN, 0}, {changes.fd(), POLLIN, 0},
                     {watcher.stopped_fd(), POLLIN, 0}};
    if (poll(fds, 4, timeout_ms) < 0 && errno != EINTR) throw std::runtime_error(describe_errno("poll"));
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
    // The watcher stopped the group while turnstile was stopped; we run again, so continue it
    // (after the settling time) unless the hold was lost meanwhile.
    if ((fds[3].revents & POLLIN) && watcher.take_stopped() && !lost) {
      continue_at = Clock::now() + kSettleAfterContinue;
    }
    if (fds[0].revents & POLLIN) {
      signalfd_siginfo info{};
      if (read(signal_fd, &info, sizeof info) == sizeof info) {
        const int sig = static_cast<int>(info.ssi_signo);
        if (sig == SIGCONT) {
          if (!lost) continue_at = Clock::now() + kSettleAfterContinue;
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
      // SIGKILL at the latest half the library's margin after SIGTERM (the other half is left
      // for the kill itself); without one (none came, or the loss had none to give: the server
      // said the hold is gone, the embedded backend's state was removed), the bound from the TTL
      // turnstile knows.
      const auto margin = changes.loss_margin(std::chrono::milliseconds(20));
      const bool has_margin = margin && margin->count() > 0;
      terminate_group(std::min(grace, has_margin ? std::chrono::duration_cast<Clock::duration>(*margin / 2) : loss.kill_after));
    }
  }
  // What is left of the clean-up bound, counted from the SIGKILL or from now (the group is gone).
  const auto clean_up_until = (killed_at ? *killed_at : Clock::now()) + LossBounds::kCleanUp;
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
      if (options.verbose) complain("released " + what);
      on_loss.reset();  // waits for a callback running right now
      close(lost_fd);
      return status;
    }
  } else {
    release_within(hold, std::max(Clock::duration::zero(), clean_up_until - Clock::now()));
  }
  // Lost: exit now. The client's clean-up could wait on a connection that is gone; the server's
  // expiry removes whatever is left.
  std::fflush(nullptr);
  _exit(exec_errno != 0 ? status : kExitHoldLost);
}

}  // namespace

namespace {

// What run and hold do with a hold once it is taken; returns turnstile's exit status.
using HeldBody = std::function<int(Client& client, Hold& hold, const std::string& what, int signal_fd,
                                   const sigset_t& original_mask, StateChanges& changes)>;

// Connects, takes the hold (one try first, then the wait --timeout allows), and hands it to
// `body`; the exit status when it is not taken (busy, a signal first, an error).
int take_hold_then(const RunOptions& options, const HeldBody& body) {
  const Kind kind = options.lock ? Kind::lock : options.read ? Kind::read : options.write ? Kind::write : Kind::semaphore;
  const std::string name = options.lock ? *options.lock
                           : options.read ? *options.read
                           : options.write ? *options.write
                                           : *options.semaphore;
  const auto what = what_is_held(kind, name, options);

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
    client_options.holder_label = options.holder_label;
    // The deadline counts from before connecting: --timeout bounds the whole wait.
    const auto started = std::chrono::steady_clock::now();
    Wait wait = kTryOnce;
    if (!options.timeout_sec) {
      wait.emplace(std::nullopt);
    } else if (*options.timeout_sec > 0) {
      wait.emplace(started +
                   std::chrono::ceil<std::chrono::steady_clock::duration>(std::chrono::duration<double>(*options.timeout_sec)));
    }
    auto connect_within = std::chrono::duration<double>(options.connect_timeout_sec);
    if (options.timeout_sec && *options.timeout_sec > 0) {
      connect_within = std::min(connect_within, std::chrono::duration<double>(*options.timeout_sec));
    } else if (options.timeout_sec && !options.connect_timeout_given) {
      // --timeout 0 (flock -n): a try, connecting included, is not held up by a dead server
      // for the whole default connect timeout.
      connect_within = std::min(connect_within, std::chrono::duration<double>(kTryOnceConnect));
    }
    client_options.connect_timeout =
        std::max(std::chrono::milliseconds(1), std::chrono::ceil<std::chrono::milliseconds>(connect_within));
    auto client = connect_backend(options.backend, std::move(client_options));
    if (options.ttl_sec && *options.ttl_sec > 0 && client.url().starts_with("file:")) {
      complain("note: --ttl has no effect on " + client.url() +
               ": a hold on the embedded backend lasts exactly as long as its process");
    }
    // Try once first: uncontended, that is the whole acquisition. On file:// a try is quick, so
    // no signal thread is started for it; a network try waits for the server, and a signal
    // meanwhile must still stop the command from starting (see AcquisitionGuard).
    std::optional<AcquisitionGuard> guard;
    if (!client.url().starts_with("file:")) guard.emplace(signal_fd, name);
    auto hold = acquire(client, kind, name, options, kTryOnce);
    if (!hold && wait && !(guard && guard->token().stop_requested())) {
      if (options.verbose) {
        const auto queue = look_at_queue(client, name);
        std::string text = "waiting for " + what + " on " + client.url();
        if (options.timeout_sec) text += " (at most " + seconds_text(*options.timeout_sec) + " s in all)";
        text += held_by(queue);
        if (queue.known && queue.waiters > 0) text += "; " + std::to_string(queue.waiters) + " waiting ahead";
        complain(text);
      }
      if (!guard) guard.emplace(signal_fd, name);
      hold = acquire(client, kind, name, options, wait, guard->token());
    }
    // Any signal until now came before the hold was used: the command is not run.
    int cancelled_by = guard ? guard->disarm() : 0;
    if (const int unread = cancelling_signal(signal_fd); cancelled_by == 0) cancelled_by = unread;
    if (cancelled_by != 0) {
      const bool run = !options.command.empty();
      complain(std::string(strsignal(cancelled_by)) + (run ? " before the command started; " : " before it was held; ") +
               give_back_after_signal(client, name, hold) + (run ? "; the command was not run" : ""));
      return 128 + cancelled_by;
    }
    if (!hold) {
      const auto holder = held_by(look_at_queue(client, name));
      if (*options.timeout_sec == 0) {
        complain("'" + name + "' is busy" + holder);
      } else {
        char seconds[32];
        std::snprintf(seconds, sizeof seconds, "%g", *options.timeout_sec);
        complain("timed out after " + std::string(seconds) + " s waiting for '" + name + "'" + holder);
      }
      return options.conflict_exit_code.value_or(kExitTimeout);
    }
    if (options.verbose) {
      const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - started;
      complain("got " + what + " on " + client.url() + " at " + iso8601(std::chrono::system_clock::now()) + " after " +
               seconds_text(waited.count()) + " s; fencing token " + std::to_string(hold->token));
    }
    return body(client, *hold, what, signal_fd, original_mask, changes);
  } catch (const Error& error) {
    complain(error.what());
    return exit_status_for(error);
  } catch (const std::exception& error) {
    complain(error.what());
    return kExitOsError;
  }
}

// Whether `fd` is a pipe, FIFO or socket: what a script gives `turnstile hold` to talk with it
// (coproc, a pipeline, process substitution). A terminal is the user's (reading it would take
// their input), and /dev/null or a file would end the hold at once.
bool is_channel(int fd) {
  struct stat st {};
  return fstat(fd, &st) == 0 && (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode));
}

bool write_all(int fd, std::string_view text) {
  while (!text.empty()) {
    const ssize_t n = write(fd, text.data(), text.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    text.remove_prefix(static_cast<std::size_t>(n));
  }
  return true;
}

// `turnstile hold`: prints the token and keeps the hold until stdin (a pipe) reaches its end,
// the reader of stdout (a pipe) goes away, or a terminating signal comes; then releases it.
// Returns 0 when it was kept until then; _exits 70 when it was lost meanwhile.
int keep(Hold& hold, const std::string& what, const RunOptions& options, int signal_fd,
         StateChanges& changes) {
  const int lost_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (lost_fd < 0) throw std::runtime_error(describe_errno("eventfd"));
  const auto wake = [lost_fd] {
    const std::uint64_t one = 1;
    (void)!write(lost_fd, &one, sizeof one);
  };
  std::optional<std::stop_callback<decltype(wake)>> on_loss(std::in_place, hold.lost, wake);

  std::string ended_by;
  if (!write_all(STDOUT_FILENO, std::to_string(hold.token) + "\n")) {
    complain(describe_errno("cannot write the fencing token to stdout") + "; releasing");
    ended_by = "error";
  }
  const bool watch_stdin = is_channel(STDIN_FILENO);
  const bool watch_stdout = is_channel(STDOUT_FILENO);
  bool lost = false, suspended = false;
  while (ended_by.empty()) {
    // A pollfd of -1 is skipped; stdout is polled for nothing but its errors (reader gone).
    pollfd fds[5] = {{signal_fd, POLLIN, 0}, {lost_fd, POLLIN, 0}, {changes.fd(), POLLIN, 0},
                     {watch_stdin ? STDIN_FILENO : -1, POLLIN, 0}, {watch_stdout ? STDOUT_FILENO : -1, 0, 0}};
    if (poll(fds, 5, -1) < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(describe_errno("poll"));
    }
    if (fds[1].revents & POLLIN) {
      lost = true;
      break;
    }
    if (fds[2].revents & POLLIN) {
      const auto [state, reason] = changes.take();
      if (state == HoldState::suspended && !suspended) {
        suspended = true;
        complain("the hold on '" + hold_name(options) + "' is suspended (" + reason + ")");
      } else if (state == HoldState::held && suspended) {
        suspended = false;
        complain("the hold on '" + hold_name(options) + "' is confirmed again");
      }
    }
    if (fds[0].revents & POLLIN) {
      signalfd_siginfo info{};
      if (read(signal_fd, &info, sizeof info) == sizeof info) {
        const int sig = static_cast<int>(info.ssi_signo);
        if (sig == SIGTSTP) {
          stop_self();
        } else if (sig == SIGINT || sig == SIGTERM || sig == SIGHUP || sig == SIGQUIT) {
          ended_by = strsignal(sig);
        }
      }
    }
    if (fds[3].revents) {
      // Whatever is written to stdin means nothing; its end is the signal to let go.
      char bytes[4096];
      const ssize_t n = read(STDIN_FILENO, bytes, sizeof bytes);
      if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) ended_by = "stdin closed";
    }
    if (fds[4].revents & (POLLERR | POLLHUP | POLLNVAL)) ended_by = "the reader of stdout went away";
  }
  if (!lost && hold.lost.stop_requested()) lost = true;  // lost as we were told to let go
  if (lost) {
    complain("the hold on '" + hold_name(options) + "' (fencing token " + std::to_string(hold.token) +
             ") may have been lost");
    release_within(hold, LossBounds::kCleanUp);
    // The client's clean-up could wait on a connection that is gone; the server's expiry
    // removes whatever is left.
    std::fflush(nullptr);
    _exit(kExitHoldLost);
  }
  int status = ended_by == "error" ? kExitOsError : 0;
  try {
    hold.release();
    if (options.verbose) complain("released " + what + " (" + ended_by + ")");
  } catch (const HoldLost& error) {
    complain(error.what());
    status = kExitHoldLost;
  } catch (const Error& error) {
    complain(std::string("releasing the hold failed: ") + error.what());
    status = exit_status_for(error);
  }
  on_loss.reset();  // waits for a callback running right now
  close(lost_fd);
  return status;
}

}  // namespace

int run_command(const RunOptions& given) {
  if (const auto problem = usage_problem(given, true); !problem.empty()) {
    complain(problem);
    return kExitUsage;
  }
  RunOptions options = given;
  if (options.shell) options.command = {"/bin/sh", "-c", *options.shell};
  return take_hold_then(options, [&](Client& client, Hold& hold, const std::string& what, int signal_fd,
                                     const sigset_t& original_mask, StateChanges& changes) {
    return supervise(hold, hold_name(options), what, options, signal_fd, original_mask,
                     loss_bounds(options, client.url()), changes);
  });
}

int hold_command(const RunOptions& options) {
  if (const auto problem = usage_problem(options, false); !problem.empty()) {
    complain(problem);
    return kExitUsage;
  }
  // A reader of stdout that went away is an error on write, not a signal that kills us.
  ::signal(SIGPIPE, SIG_IGN);
  return take_hold_then(options, [&](Client&, Hold& hold, const std::string& what, int signal_fd, const sigset_t&,
                                     StateChanges& changes) {
    return keep(hold, what, options, signal_fd, changes);
  });
}

}  // namespace turnstile::cli
