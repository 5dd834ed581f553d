// SPDX-License-Identifier: Apache-2.0
// A peer program of another ecosystem (a python3-consul candidate, say) run as a child and
// driven by lines: commands on its stdin, one answer line each on its stdout.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace turnstile_test {

class PeerProcess {
 public:
  // Runs `argv` (argv[0] is the program: a path, or a name looked up in PATH) and waits up to
  // `ready_within` for its first line, which must be "ready".
  explicit PeerProcess(const std::vector<std::string>& argv,
                       std::chrono::milliseconds ready_within = std::chrono::seconds(30)) {
    int down[2], up[2];
    if (pipe2(down, O_CLOEXEC) != 0) return;
    if (pipe2(up, O_CLOEXEC) != 0) {
      close(down[0]);
      close(down[1]);
      return;
    }
    std::vector<char*> args;
    for (const auto& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
    args.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      dup2(down[0], STDIN_FILENO);
      dup2(up[1], STDOUT_FILENO);
      execvp(args[0], args.data());
      _exit(127);
    }
    close(down[0]);
    close(up[1]);
    to_peer_ = down[1];
    from_peer_ = up[0];
    ready_ = line(ready_within) == "ready";
  }
  ~PeerProcess() {
    tell("quit");
    if (to_peer_ >= 0) close(to_peer_);
    if (from_peer_ >= 0) close(from_peer_);
    if (pid_ <= 0) return;
    for (int i = 0; i < 100 && waitpid(pid_, nullptr, WNOHANG) == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;

  bool ready() const { return ready_; }
  void tell(const std::string& command) {
    const auto text = command + "\n";
    if (to_peer_ >= 0) static_cast<void>(!write(to_peer_, text.data(), text.size()));
  }
  // The peer's next line, or "" when none comes within `timeout`.
  std::string line(std::chrono::milliseconds timeout = std::chrono::seconds(15)) {
    const auto until = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (const auto end = pending_.find('\n'); end != std::string::npos) {
        auto first = pending_.substr(0, end);
        pending_.erase(0, end + 1);
        return first;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (left.count() <= 0 || from_peer_ < 0) return "";
      pollfd readable{from_peer_, POLLIN, 0};
      if (poll(&readable, 1, static_cast<int>(left.count())) <= 0) continue;
      char bytes[512];
      const auto got = read(from_peer_, bytes, sizeof bytes);
      if (got <= 0) return "";
      pending_.append(bytes, static_cast<std::size_t>(got));
    }
  }
  // A command and its answer.
  std::string ask(const std::string& command, std::chrono::milliseconds timeout = std::chrono::seconds(15)) {
    tell(command);
    return line(timeout);
  }

 private:
  pid_t pid_ = -1;
  int to_peer_ = -1;
  int from_peer_ = -1;
  bool ready_ = false;
  std::string pending_;
};

}  // namespace turnstile_test
