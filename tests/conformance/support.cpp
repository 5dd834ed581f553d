// SPDX-License-Identifier: Apache-2.0
#include "conformance/support.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

namespace conformance {

std::string param_label(const ::testing::TestParamInfo<BackendParam>& info) { return info.param.label; }

void Conformance::SetUp() {
  char scratch[] = "/tmp/turnstile-conformance-XXXXXX";
  ASSERT_NE(mkdtemp(scratch), nullptr) << std::strerror(errno);
  scratch_ = scratch;
  url_ = GetParam().url.empty() ? "file://" + scratch_ + "/backend" : GetParam().url;
  if (url_.front() == '@') {
    std::ifstream file(url_.substr(1));
    std::getline(file, url_);
    ASSERT_FALSE(url_.empty()) << "no server URL in " << GetParam().url.substr(1) << " (did its CTest fixture run?)";
  }
  std::random_device random;
  char prefix[64];
  std::snprintf(prefix, sizeof prefix, "conformance/%d-%08x", static_cast<int>(getpid()), random());
  prefix_ = prefix;
  if (url_.rfind("file:", 0) == 0) client();  // cheap, and reports a bad directory at once
}

void Conformance::TearDown() {
  client_.reset();
  if (!scratch_.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(scratch_, ignored);
  }
}

turnstile::Client Conformance::connect(turnstile::ClientOptions options) const {
  return turnstile::Client::connect(url_, std::move(options));
}

bool Conformance::eventually(const std::function<bool()>& predicate, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (predicate()) return true;
    if (Clock::now() >= deadline) return predicate();
    std::this_thread::sleep_for(2ms);
  }
}

turnstile::Client& Conformance::client() {
  std::lock_guard lock(client_mutex_);
  if (!client_) client_.emplace(turnstile::Client::connect(url_));
  return *client_;
}

std::size_t Conformance::waiter_count(const std::string& name) { return client().inspect(name).waiters.size(); }
std::size_t Conformance::holder_count(const std::string& name) { return client().inspect(name).holders.size(); }

bool Conformance::wait_for_waiters(const std::string& name, std::size_t count, std::chrono::milliseconds timeout) {
  return eventually([&] { return waiter_count(name) == count; }, timeout);
}

void Conformance::expect_sound(const std::vector<th::HoldRecord>& history, std::int64_t limit) {
  const auto violations = th::check(history, limit);
  EXPECT_TRUE(violations.empty()) << violations.size() << " violation(s) in " << history.size() << " holds:\n"
                                  << th::describe(violations);
}

Child Child::spawn(std::function<int()> body) { return fork_with(std::move(body), false); }
Child Child::spawn_gated(std::function<int()> body) { return fork_with(std::move(body), true); }

Child Child::fork_with(std::function<int()> body, bool gated) {
  int go[2] = {-1, -1};
  if (gated && pipe2(go, O_CLOEXEC) != 0) {
    ADD_FAILURE() << "pipe: " << std::strerror(errno);
    return Child(-1, -1);
  }
  std::fflush(nullptr);  // no buffered output duplicated into the child
  const pid_t pid = fork();
  if (pid < 0) {
    ADD_FAILURE() << "fork: " << std::strerror(errno);
    if (gated) {
      close(go[0]);
      close(go[1]);
    }
    return Child(-1, -1);
  }
  if (pid == 0) {
    if (gated) {
      close(go[1]);
      pollfd pfd{go[0], POLLIN, 0};
      char byte = 0;
      while (poll(&pfd, 1, 30'000) < 0 && errno == EINTR) {
      }
      if (read(go[0], &byte, 1) != 1) _exit(96);  // never started
      close(go[0]);
    }
    int status = 98;
    try {
      status = body();
    } catch (const std::exception& error) {
      std::fprintf(stderr, "child %d: %s\n", static_cast<int>(getpid()), error.what());
      status = 99;
    } catch (...) {
      status = 99;
    }
    std::fflush(nullptr);
    _exit(status);  // no destructors: the parent's objects live on in this copy of memory
  }
  if (gated) close(go[0]);
  return Child(pid, gated ? go[1] : -1);
}

void Child::start() {
  if (go_fd_ < 0) return;
  const char byte = '!';
  while (write(go_fd_, &byte, 1) < 0 && errno == EINTR) {
  }
  close(go_fd_);
  go_fd_ = -1;
}

Child::~Child() {
  if (go_fd_ >= 0) close(go_fd_);
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    int status = 0;
    while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
  }
}

int Child::wait(std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return -1;
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    int status = 0;
    const pid_t done = waitpid(pid_, &status, WNOHANG);
    if (done == pid_) {
      pid_ = -1;
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
      return -1;
    }
    if (done < 0 && errno != EINTR) return -1;
    if (Clock::now() >= deadline) {
      ADD_FAILURE() << "child " << pid_ << " did not end within " << timeout.count() << " ms; killing it";
      ::kill(pid_, SIGKILL);
      while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
      }
      pid_ = -1;
      return -1;
    }
    std::this_thread::sleep_for(2ms);
  }
}

bool Child::running() {
  if (pid_ <= 0) return false;
  siginfo_t info{};
  if (waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOHANG | WNOWAIT) != 0) return false;
  return info.si_pid == 0;  // nothing to report yet: still running
}

void Child::kill(int signal) {
  if (pid_ > 0) ::kill(pid_, signal);
}

Pipe::Pipe() {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    ADD_FAILURE() << "pipe: " << std::strerror(errno);
    return;
  }
  read_fd_ = fds[0];
  write_fd_ = fds[1];
}

Pipe::~Pipe() {
  if (read_fd_ >= 0) close(read_fd_);
  if (write_fd_ >= 0) close(write_fd_);
}

void Pipe::send(char byte) {
  while (write(write_fd_, &byte, 1) < 0 && errno == EINTR) {
  }
}

void Pipe::close_write() {
  if (write_fd_ >= 0) close(write_fd_);
  write_fd_ = -1;
}

std::optional<char> Pipe::receive(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() < 0) return std::nullopt;
    pollfd pfd{read_fd_, POLLIN, 0};
    const int ready = poll(&pfd, 1, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return std::nullopt;
    char byte;
    const ssize_t got = read(read_fd_, &byte, 1);
    if (got < 0 && errno == EINTR) continue;
    if (got != 1) return std::nullopt;
    return byte;
  }
}

void run_threads(int count, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(count));
  for (int i = 0; i < count; ++i) threads.emplace_back(body, i);
  for (auto& thread : threads) thread.join();
}

void linger_in_child(std::chrono::seconds at_most) {
  std::this_thread::sleep_for(at_most);
  _exit(97);
}

}  // namespace conformance
