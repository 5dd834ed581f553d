// SPDX-License-Identifier: Apache-2.0
// The CLI tests' fixture: turnstile started as users run it (a separate process, its output in
// files), bounded waits, and the helpers the file:// and server tests share.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "testing/hold_history.hpp"

namespace cli_tests {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

constexpr auto kDeadline = 60s;  // generous: the machine may be loaded

inline std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

inline void write_file(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

inline bool wait_until(const std::function<bool()>& done, std::chrono::seconds deadline = kDeadline) {
  const auto until = std::chrono::steady_clock::now() + deadline;
  while (std::chrono::steady_clock::now() < until) {
    if (done()) return true;
    std::this_thread::sleep_for(20ms);
  }
  return done();
}

// Whether a process no longer exists (reaped here if it became our child: we are the subreaper).
inline bool gone(pid_t pid) {
  waitpid(pid, nullptr, WNOHANG);
  return kill(pid, 0) != 0 && errno == ESRCH;
}

// Whether a process has died and waits to be reaped (its /proc/PID/stat says 'Z'): not reaped here.
inline bool zombie(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto end = text.rfind(')');
  return end != std::string::npos && end + 2 < text.size() && text[end + 2] == 'Z';
}

inline std::uint64_t read_number(const std::string& path) {
  const auto text = read_file(path);
  return text.empty() ? 0 : std::stoull(text);
}

// The descriptor numbers `cli_probe_child fds LISTING` found open, sorted.
inline std::vector<int> listed_descriptors(const std::string& listing) {
  std::istringstream lines(read_file(listing));
  std::vector<int> fds;
  std::string line;
  while (std::getline(lines, line)) fds.push_back(std::stoi(line));
  std::sort(fds.begin(), fds.end());
  return fds;
}

// What `cli_probe_child beat LOG` logged: its beats and when SIGTERM came (CLOCK_MONOTONIC ns).
struct BeatLog {
  std::vector<std::uint64_t> beats;
  std::uint64_t term = 0;  // 0: never
  std::uint64_t last() const { return beats.empty() ? 0 : beats.back(); }
  // Whether the command beat (ran) at some time in [from, to).
  bool beat_within(std::uint64_t from, std::uint64_t to) const {
    return std::any_of(beats.begin(), beats.end(), [&](std::uint64_t t) { return t >= from && t < to; });
  }
};
inline BeatLog read_beats(const std::string& path) {
  std::istringstream lines(read_file(path));
  BeatLog log;
  char kind = 0;
  std::uint64_t at = 0;
  while (lines >> kind >> at) {
    if (kind == 'T' && log.term == 0) log.term = at;
    if (kind == 'B') log.beats.push_back(at);
  }
  return log;
}

// The schemes an unknown-scheme message lists ("(expected file, redis, ... or consuls)");
// empty when it lists none.
inline std::vector<std::string> schemes_listed(const std::string& message) {
  const auto open = message.find("(expected "), close = message.find(')', open);
  if (open == std::string::npos || close == std::string::npos) return {};
  std::string list = message.substr(open + 10, close - open - 10);
  std::replace(list.begin(), list.end(), ',', ' ');
  std::istringstream words(list);
  std::vector<std::string> schemes;
  for (std::string word; words >> word;) {
    if (word != "or") schemes.push_back(word);
  }
  return schemes;
}

// Exit status as a shell reports it: the code, or 128 + the signal.
inline int shell_status(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }

struct Process {
  pid_t pid = -1;
  std::string out_path, err_path;
  int stdin_fd = -1;   // with Launch::stdin_pipe: the write end of its stdin (close it to send EOF)
  int stdout_fd = -1;  // with Launch::stdout_pipe: the read end of its stdout
  std::string out() const { return read_file(out_path); }
  std::string err() const { return read_file(err_path); }
};

// One line read from `fd` (without its newline); "" at end of file or after the deadline.
inline std::string read_line(int fd, std::chrono::seconds deadline = kDeadline) {
  std::string line;
  const auto until = std::chrono::steady_clock::now() + deadline;
  for (char c; std::chrono::steady_clock::now() < until;) {
    pollfd ready{fd, POLLIN, 0};
    if (poll(&ready, 1, 20) <= 0) continue;
    if (read(fd, &c, 1) != 1 || c == '\n') return line;
    line += c;
  }
  return {};
}

// How to start turnstile, beyond its arguments.
struct Launch {
  std::vector<std::pair<std::string, std::optional<std::string>>> env;  // set, or unset (nullopt)
  std::optional<uid_t> uid;                                             // run as this user (the test must be root)
  bool own_group = false;                                               // in a process group of its own, as a shell job
  std::vector<std::string> prefix;                                      // run turnstile through this command
  // Its stdin and stdout are pipes to the test (Process::stdin_fd, stdout_fd) instead of
  // /dev/null and a file.
  bool stdin_pipe = false;
  bool stdout_pipe = false;
  // Turnstile starts with this signal blocked (so its command inherits it blocked, and cannot
  // die of it before it does anything), and pending too if `signal_pending`.
  int blocked_signal = 0;
  bool signal_pending = false;
};

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Orphans (the child of a SIGKILLed turnstile) come to us, so we can watch them die.
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    char dir_template[] = "/tmp/turnstile-cli-test-XXXXXX";
    ASSERT_NE(mkdtemp(dir_template), nullptr);
    dir_ = dir_template;
    backend_dir_ = dir_ + "/backend";
    backend_ = "file://" + backend_dir_;
  }

  void TearDown() override {
    for (int fd : pipe_ends_) close(fd);
    pipe_ends_.clear();
    for (pid_t pid : started_) {
      if (kill(pid, 0) == 0) kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  std::string path(const std::string& file) const { return dir_ + "/" + file; }

  // Starts `turnstile ARGS...` with stdin from /dev/null and stdout/stderr to files.
  Process start(const std::vector<std::string>& args, const Launch& launch = {}) {
    std::vector<std::string> argv_strings = launch.prefix;
    argv_strings.push_back(TURNSTILE_CLI_PATH);
    argv_strings.insert(argv_strings.end(), args.begin(), args.end());
    return spawn(argv_strings, launch);
  }

  // Starts any program (ARGV[0] by its path) as start() starts turnstile.
  Process spawn(std::vector<std::string> argv_strings, const Launch& launch = {}) {
    Process process;
    const int n = counter_++;
    process.out_path = path("out." + std::to_string(n));
    process.err_path = path("err." + std::to_string(n));
    int in_pipe[2] = {-1, -1}, out_pipe[2] = {-1, -1};
    if (launch.stdin_pipe) {
      EXPECT_EQ(pipe2(in_pipe, O_CLOEXEC), 0);
    }
    if (launch.stdout_pipe) {
      EXPECT_EQ(pipe2(out_pipe, O_CLOEXEC), 0);
    }
    std::vector<char*> argv;
    for (auto& arg : argv_strings) argv.push_back(arg.data());
    argv.push_back(nullptr);
    const pid_t pid = fork();
    if (pid == 0) {
      if (launch.own_group) setpgid(0, 0);
      for (const auto& [name, value] : launch.env) {
        if (value) {
          setenv(name.c_str(), value->c_str(), 1);
        } else {
          unsetenv(name.c_str());
        }
      }
      if (launch.uid && (setgid(*launch.uid) != 0 || setuid(*launch.uid) != 0)) _exit(97);
      if (launch.blocked_signal != 0) {
        // Blocked signals stay pending across exec: turnstile finds it as soon as it looks.
        sigset_t one;
        sigemptyset(&one);
        sigaddset(&one, launch.blocked_signal);
        sigprocmask(SIG_BLOCK, &one, nullptr);
        if (launch.signal_pending) kill(getpid(), launch.blocked_signal);
      }
      const int in = launch.stdin_pipe ? in_pipe[0] : open("/dev/null", O_RDONLY);
      const int out =
          launch.stdout_pipe ? out_pipe[1] : open(process.out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      const int err = open(process.err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      if (in < 0 || out < 0 || err < 0) _exit(99);
      dup2(in, 0);
      dup2(out, 1);
      dup2(err, 2);
      // Nothing of ours (or of ctest's) leaks into turnstile: any other descriptor its child
      // sees came from turnstile.
      close_range(3, ~0u, 0);
      execvp(argv[0], argv.data());
      _exit(98);
    }
    process.pid = pid;
    started_.push_back(pid);
    if (launch.stdin_pipe) {
      close(in_pipe[0]);
      process.stdin_fd = in_pipe[1];
      pipe_ends_.push_back(in_pipe[1]);
    }
    if (launch.stdout_pipe) {
      close(out_pipe[1]);
      process.stdout_fd = out_pipe[0];
      pipe_ends_.push_back(out_pipe[0]);
    }
    return process;
  }

  // Closes a pipe end of a started process (at most once: TearDown closes those left open).
  void close_pipe(int& fd) {
    if (fd < 0) return;
    std::erase(pipe_ends_, fd);
    close(fd);
    fd = -1;
  }

  // The exit status of a started process; kills it and fails after the deadline.
  int wait_exit(const Process& process, std::chrono::seconds deadline = kDeadline) {
    int status = 0;
    const bool done = wait_until([&] { return waitpid(process.pid, &status, WNOHANG) == process.pid; }, deadline);
    std::erase(started_, process.pid);
    if (!done) {
      kill(process.pid, SIGKILL);
      waitpid(process.pid, &status, 0);
      ADD_FAILURE() << "turnstile did not exit in time; stderr: " << process.err();
      return -1;
    }
    return shell_status(status);
  }

  struct Result {
    int status;
    std::string out, err;
  };
  Result run(const std::vector<std::string>& args, const Launch& launch = {}) {
    auto process = start(args, launch);
    const int status = wait_exit(process);
    return {status, process.out(), process.err()};
  }

  Result run_program(const std::vector<std::string>& argv, const Launch& launch = {}) {
    auto process = spawn(argv, launch);
    const int status = wait_exit(process);
    return {status, process.out(), process.err()};
  }

  // `turnstile run --backend B --lock NAME -- sh -c SCRIPT`
  std::vector<std::string> lock_sh(const std::string& name, const std::string& script,
                                   std::vector<std::string> extra = {}) {
    std::vector<std::string> args{"run", "--backend", backend_, "--lock", name};
    args.insert(args.end(), extra.begin(), extra.end());
    args.insert(args.end(), {"--", "sh", "-c", script});
    return args;
  }

  // A `run --lock NAME` whose child signals readiness with a file and holds until `release`
  // exists. Returns once the child runs, i.e. the lock is held.
  Process hold_until(const std::string& name, const std::string& ready, const std::string& release) {
    auto process = start(lock_sh(
        name, "echo $TURNSTILE_FENCING_TOKEN > " + ready + "; while [ ! -e " + release + " ]; do sleep 0.02; done"));
    EXPECT_TRUE(wait_until([&] { return fs::exists(ready) && !read_file(ready).empty(); }))
        << "the holder never ran; stderr: " << process.err();
    return process;
  }

  nlohmann::json inspect_json(const std::string& name) {
    const auto result = run({"inspect", "--backend", backend_, "--json", name});
    EXPECT_EQ(result.status, 0) << result.err;
    return nlohmann::json::parse(result.out);
  }

  bool waiter_count_is(const std::string& name, std::size_t count) {
    return inspect_json(name)["waiters"].size() == count;
  }

  // Issue 24 item 4, once across a fleet: two hosts' cron runs of one job 2 s apart with
  // `--timeout 0 --hold-at-least 5s` run it once (the first run ends at once, its entry holds on
  // without turnstile, and inspect shows until when); a waiter with a longer timeout is
  // admitted once the kept hold ends, not before.
  void expect_hold_at_least_runs_the_job_once(const std::string& name) {
    const auto runs = path("runs");
    const auto cron_run = [&] {
      return run(lock_sh(name, "echo run >> " + runs, {"--timeout", "0", "--hold-at-least", "5s"}));
    };
    const auto first_started = std::chrono::steady_clock::now();
    const auto first = cron_run();
    ASSERT_EQ(first.status, 0) << first.err;
    const auto kept = inspect_json(name);
    ASSERT_EQ(kept["holders"].size(), 1u) << kept.dump();
    EXPECT_TRUE(kept["holders"][0]["kept_until"].is_string()) << kept.dump();
    EXPECT_NE(run({"inspect", "--backend", backend_, name}).out.find("kept until"), std::string::npos);

    std::this_thread::sleep_until(first_started + 2s);
    const auto second = cron_run();
    EXPECT_EQ(second.status, 75) << second.err;
    EXPECT_EQ(read_file(runs), "run\n");

    const auto admitted = path("admitted");
    auto waiter = start(lock_sh(name, "touch " + admitted, {"--timeout", "60"}));
    ASSERT_TRUE(wait_until([&] { return waiter_count_is(name, 1); })) << waiter.err();  // really waiting
    EXPECT_EQ(wait_exit(waiter), 0) << waiter.err();
    EXPECT_TRUE(fs::exists(admitted));
    // Never before the kept hold ended: 5 s after the first command started, which was after this.
    EXPECT_GE(std::chrono::steady_clock::now() - first_started, 5s);
    EXPECT_EQ(read_file(runs), "run\n");
  }

  std::string dir_, backend_dir_, backend_;
  std::vector<pid_t> started_;
  std::vector<int> pipe_ends_;  // of started processes, still open
  int counter_ = 0;
};

}  // namespace cli_tests
