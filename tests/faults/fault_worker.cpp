// SPDX-License-Identifier: Apache-2.0
// The clients of a fault run: a library client taking and releasing holds of every primitive,
// a CLI client looping `turnstile run`, and the command that CLI client runs under its hold.
// Each records its holds in a hold history and its losses, time-outs and fenced writes in an
// event log (fault_log.hpp).
//
// A recorded hold is the part of the real hold the client USED: from the acquire's return to
// the last moment it checked hold_state() and saw `held`. A client never writes to the fenced
// store without that check just before, so two recorded holds that overlap mean two clients
// believed at once that they held the name: a safety violation, whatever the faults were.
#include "fault_worker.hpp"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "fault_log.hpp"
#include "testing/hold_history.hpp"
#include "turnstile/turnstile.hpp"

namespace turnstile::faults {

namespace {

using testing::monotonic_ns;
using namespace std::chrono_literals;

std::atomic<bool> g_stopping{false};

void on_stop_signal(int) { g_stopping = true; }

void catch_stop_signals() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
}

// A stop source requested once SIGTERM arrives, so waits in the library end promptly.
class StopOnSignal {
 public:
  StopOnSignal()
      : watcher_([this](std::stop_token self) {
          while (!self.stop_requested() && !g_stopping) std::this_thread::sleep_for(20ms);
          source_.request_stop();
        }) {}
  std::stop_token token() const { return source_.get_token(); }
  bool stopping() const { return source_.stop_requested(); }

 private:
  std::stop_source source_;
  std::jthread watcher_;
};

void sleep_unless_stopping(std::chrono::milliseconds total) {
  const auto until = std::chrono::steady_clock::now() + total;
  while (!g_stopping && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(5ms);
}

// When each hold was told it was lost, by (name, token), from ClientOptions::on_hold_state.
class LossNotices {
 public:
  void told(const std::string& name, std::uint64_t token) {
    std::lock_guard lock(mutex_);
    notices_.try_emplace({name, token}, monotonic_ns());
  }
  std::int64_t when(const std::string& name, std::uint64_t token) {
    std::lock_guard lock(mutex_);
    const auto it = notices_.find({name, token});
    return it == notices_.end() ? 0 : it->second;
  }

 private:
  std::mutex mutex_;
  std::map<std::pair<std::string, std::uint64_t>, std::int64_t> notices_;
};

// The use of one hold: writes (exclusive holds only) each after checking the hold is held,
// until its time is up or the hold is no longer held. Returns the end of the used part, or 0
// when the hold was never seen held (an acquire that returned after the hold's own loss
// deadline, e.g. in a client paused just as it was admitted: nothing was used).
template <class StateOf>
std::int64_t use_hold(const std::string& name, std::uint64_t token, bool exclusive, std::chrono::milliseconds length,
                      StateOf state_of, FencedStore& store, EventLog& events, bool& was_lost, bool ignore_loss) {
  std::int64_t used_until = 0;
  const auto until = std::chrono::steady_clock::now() + length;
  for (;;) {
    const auto state = ignore_loss ? HoldState::held : state_of();
    if (state != HoldState::held) {
      was_lost = state == HoldState::lost;
      return used_until;
    }
    used_until = monotonic_ns();
    if (exclusive) {
      const auto outcome = store.write(name, token);
      events.line("write " + name + " " + std::to_string(token) + " " + std::to_string(outcome.ordered_ns) + " " +
                  (outcome.accepted ? "1" : "0"));
    }
    if (g_stopping || std::chrono::steady_clock::now() >= until) return used_until;
    std::this_thread::sleep_for(std::min<std::chrono::milliseconds>(
        10ms, std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now()) + 1ms));
  }
}

Client connect_until_stopped(const WorkerOptions& options, ClientOptions client_options, EventLog& events) {
  for (;;) {
    try {
      return Client::connect(options.url, client_options);
    } catch (const Error& error) {
      if (error.code() != ErrorCode::backend_unavailable || g_stopping) throw;
      events.line("error connect " + std::to_string(monotonic_ns()) + " " + error.what());
      sleep_unless_stopping(200ms);
      if (g_stopping) throw;
    }
  }
}

}  // namespace

int worker_main(const WorkerOptions& options) {
  catch_stop_signals();
  const auto base = options.out_dir + "/client-" + std::to_string(options.id) + "-" + std::to_string(::getpid());
  testing::FileHoldRecorder history(base + ".history");
  EventLog events(base + ".events");
  FencedStore store(options.store_dir);
  LossNotices notices;
  ClientOptions client_options;
  client_options.ttl = options.ttl;
  client_options.connect_timeout = 2s;
  client_options.holder_label = "fault client " + std::to_string(options.id);
  client_options.on_hold_state = [&](const HoldStateChange& change) {
    if (change.state == HoldState::lost) notices.told(change.name, change.fencing_token);
  };
  client_options.error_handler = [&](const Error& error) {
    events.line("error background " + std::to_string(monotonic_ns()) + " " + error.what());
  };
  Client client = [&] {
    try {
      return connect_until_stopped(options, client_options, events);
    } catch (const Error&) {
      std::exit(g_stopping ? 0 : 69);
    }
  }();
  StopOnSignal stop;
  std::mt19937_64 random(options.seed);
  const auto names = run_names(options.prefix, options.names_per_kind);
  // Where the backend has no election layout yet, its election names are passed over.
  const bool elections = [&] {
    try {
      static_cast<void>(client.election(options.prefix + "/elect0"));
      return true;
    } catch (const InvalidArgument&) {
      return false;
    }
  }();
  while (!g_stopping) {
    const auto& name = names[random() % names.size()];
    // Mostly short holds; 3 in 100 last one to two TTLs, so that holds live through renewals
    // (a renewal confirmed wrongly shows only in a hold that outlives the lease it renewed).
    const auto length =
        random() % 100 < 3
            ? options.ttl + std::chrono::milliseconds(random() % static_cast<std::uint64_t>(options.ttl.count()))
            : std::chrono::milliseconds(5 + random() % 30);
    testing::HoldRecord record;
    record.name = name;
    record.request_ns = monotonic_ns();
    bool was_lost = false;
    try {
      if (is_election_name(name)) {
        if (!elections) continue;
        auto election = client.election(name);
        if (!election.campaign_for("fault client " + std::to_string(options.id), options.acquire_timeout,
                                   stop.token())) {
          if (!stop.stopping()) {
            events.line("timeout " + name + " " + std::to_string(record.request_ns) + " " +
                        std::to_string(monotonic_ns()));
          }
          continue;
        }
        record.start_ns = monotonic_ns();
        record.kind = "exclusive";  // one leader at a time: the exclusive no-overlap check
        record.token = election.fencing_token();
        record.end_ns = use_hold(
            name, record.token, true, length, [&] { return election.hold_state(); }, store, events, was_lost,
            options.ignore_loss);
        if (record.end_ns != 0) history.record(record);
        election.resign();
      } else if (is_semaphore_name(name)) {
        auto semaphore = client.semaphore(name, kSemaphoreLimit);
        auto lease = semaphore.try_acquire_for(options.acquire_timeout, 1, stop.token());
        if (!lease) {
          if (!stop.stopping()) {
            events.line("timeout " + name + " " + std::to_string(record.request_ns) + " " +
                        std::to_string(monotonic_ns()));
          }
          continue;
        }
        record.start_ns = monotonic_ns();
        record.kind = "lease";
        record.token = lease->fencing_token();
        record.end_ns = use_hold(
            name, record.token, false, length, [&] { return lease->hold_state(); }, store, events, was_lost,
            options.ignore_loss);
        if (record.end_ns != 0) history.record(record);
        lease->release();
      } else {
        // Mutexes, and writers and readers of SharedMutexes (all on the "lock" queue kind).
        auto hold = [&](auto& lock, bool reader) {
          bool got = false;
          if constexpr (requires { lock.try_lock_shared_for(options.acquire_timeout, stop.token()); }) {
            got = reader ? lock.try_lock_shared_for(options.acquire_timeout, stop.token())
                         : lock.try_lock_for(options.acquire_timeout, stop.token());
          } else {
            got = lock.try_lock_for(options.acquire_timeout, stop.token());
          }
          if (!got) {
            if (!stop.stopping()) {
              events.line("timeout " + name + " " + std::to_string(record.request_ns) + " " +
                          std::to_string(monotonic_ns()));
            }
            return;
          }
          record.start_ns = monotonic_ns();
          record.kind = reader ? "shared" : "exclusive";
          record.token = lock.fencing_token();
          record.end_ns = use_hold(
              name, record.token, !reader, length, [&] { return lock.hold_state(); }, store, events, was_lost,
              options.ignore_loss);
          if (record.end_ns != 0) history.record(record);
          if constexpr (requires { lock.release_shared(); }) {
            if (reader) {
              lock.release_shared();
              return;
            }
          }
          lock.release();
        };
        if (name.find("/rw") != std::string::npos) {
          auto lock = client.shared_mutex(name);
          hold(lock, random() % 2 == 0);
        } else {
          auto lock = client.mutex(name);
          hold(lock, false);
        }
      }
    } catch (const Error& error) {
      // A lost hold's release reports HoldLost; a server down reports BackendUnavailable.
      if (error.code() != ErrorCode::hold_lost) {
        events.line("error " + name + " " + std::to_string(monotonic_ns()) + " " + error.what());
        sleep_unless_stopping(50ms);
      } else {
        was_lost = true;
      }
    }
    if (was_lost && record.start_ns != 0) {
      // Told through on_hold_state (a background thread) at most a moment after hold_state()
      // showed it; wait for the notice a little so its time is known.
      std::int64_t told = 0;
      for (int i = 0; i < 100 && (told = notices.when(name, record.token)) == 0; ++i) std::this_thread::sleep_for(10ms);
      events.line("lost " + name + " " + std::to_string(record.token) + " " + std::to_string(record.start_ns) + " " +
                  std::to_string(told != 0 ? told : monotonic_ns()));
    }
  }
  return 0;
}

int cli_child_main(const std::string& history_path, const std::string& events_path, const std::string& store_dir,
                   std::chrono::milliseconds length) {
  const char* token_text = std::getenv("TURNSTILE_FENCING_TOKEN");
  const char* name = std::getenv("TURNSTILE_NAME");
  if (!token_text || !name) return 2;
  testing::HoldRecord record;
  record.name = name;
  record.kind = "exclusive";
  record.token = std::stoull(token_text);
  // Started after turnstile acquired; `turnstile run` stops this process (its whole group)
  // before anyone else may be admitted when it loses the hold, so the end is inside the hold.
  record.start_ns = monotonic_ns();
  FencedStore store(store_dir);
  EventLog events(events_path);
  const auto outcome = store.write(name, record.token);
  events.line("write " + std::string(name) + " " + token_text + " " + std::to_string(outcome.ordered_ns) + " " +
              (outcome.accepted ? "1" : "0"));
  std::this_thread::sleep_for(length);
  record.end_ns = monotonic_ns();
  testing::FileHoldRecorder(history_path).record(record);
  return 0;
}

int cli_worker_main(const WorkerOptions& options, const std::string& cli_path, const std::string& self_path) {
  catch_stop_signals();
  const auto base = options.out_dir + "/cli-" + std::to_string(options.id) + "-" + std::to_string(::getpid());
  EventLog events(base + ".events");
  std::mt19937_64 random(options.seed);
  std::vector<std::string> mutexes;
  for (const auto& name : run_names(options.prefix, options.names_per_kind)) {
    if (name.find("/mutex") != std::string::npos) mutexes.push_back(name);
  }
  const auto ttl_seconds = std::to_string(std::max<std::int64_t>(1, options.ttl.count() / 1000));
  const auto timeout_seconds = std::to_string(std::max<std::int64_t>(1, options.acquire_timeout.count() / 1000));
  while (!g_stopping) {
    const auto& name = mutexes[random() % mutexes.size()];
    const auto length = std::to_string(5 + random() % 30);
    const auto request_ns = monotonic_ns();
    const pid_t child = ::fork();
    if (child == 0) {
      // What turnstile says (lost holds, busy servers) goes to the client's log.
      const int log = ::open((base + ".log").c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
      if (log >= 0) ::dup2(log, STDERR_FILENO);
      std::vector<std::string> args{
          cli_path,         "run",       "--backend", options.url, "--timeout", timeout_seconds,
          "--holder-label", "fault cli", "--lock",    name};
      // file:// has no TTL (turnstile says so); every other backend gets the run's.
      if (!options.url.starts_with("file:")) args.insert(args.end(), {"--ttl", ttl_seconds});
      args.insert(args.end(),
                  {"--", self_path, "cli-child", base + ".history", base + ".events", options.store_dir, length});
      std::vector<char*> argv;
      for (auto& arg : args) argv.push_back(arg.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    int status = 0;
    while (::waitpid(child, &status, 0) < 0) {
      if (errno != EINTR) return 70;
      if (g_stopping) ::kill(child, SIGTERM);  // turnstile run leaves the queue and exits
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == 75) {
      events.line("timeout " + name + " " + std::to_string(request_ns) + " " + std::to_string(monotonic_ns()));
    } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      events.line("error " + name + " " + std::to_string(monotonic_ns()) + " turnstile run ended with status " +
                  std::to_string(status));
      sleep_unless_stopping(50ms);
    }
  }
  return 0;
}

}  // namespace turnstile::faults
