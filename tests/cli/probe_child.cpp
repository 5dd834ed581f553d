// SPDX-License-Identifier: Apache-2.0
// Helpers the CLI tests run as commands, where a shell would add descriptors or cannot do it.
//   cli_probe_child fds OUT             writes each open descriptor and its target, one a line
//   cli_probe_child count-signals READY LOG
//                                       touches READY, then logs each SIGINT it receives ("INT"
//                                       lines) and exits 0 at the first SIGTERM ("TERM")
//   cli_probe_child stamp FILE          writes the CLOCK_MONOTONIC time (ns) to FILE
//   cli_probe_child beat LOG            a stubborn command: appends "B <ns>" to LOG every 5 ms
//                                       (CLOCK_MONOTONIC); at SIGTERM appends "T <ns>" and goes
//                                       on beating; exits 0 at SIGINT
//   cli_probe_child hostname NAME CMD…  in a UTS namespace of its own, sets the host name to the
//                                       bytes NAME (with \e and \xNN escapes) and runs CMD
// Exit 77 when the namespace cannot be made (the test then skips).
#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>

namespace {

int list_descriptors(const char* out_path) {
  FILE* out = std::fopen(out_path, "w");
  if (!out) return 2;
  const int out_fd = fileno(out);
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return 2;
  const int dir_fd = dirfd(dir);
  while (const dirent* entry = readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    const int fd = std::atoi(entry->d_name);
    if (fd == dir_fd || fd == out_fd) continue;  // our own, opened just now
    char target[4096] = {};
    const std::string link = std::string("/proc/self/fd/") + entry->d_name;
    if (readlink(link.c_str(), target, sizeof target - 1) < 0) std::strcpy(target, "?");
    std::fprintf(out, "%d %s\n", fd, target);
  }
  closedir(dir);
  return std::fclose(out) == 0 ? 0 : 2;
}

std::string unescape(const char* text) {
  std::string out;
  for (const char* p = text; *p; ++p) {
    if (p[0] == '\\' && p[1] == 'e') {
      out += '\x1b';
      ++p;
    } else if (p[0] == '\\' && p[1] == 'x' && p[2] && p[3]) {
      out += static_cast<char>(std::strtol(std::string(p + 2, 2).c_str(), nullptr, 16));
      p += 3;
    } else {
      out += *p;
    }
  }
  return out;
}

// Takes the signals synchronously, each as it comes, so a second delivery is seen as soon as it
// is sent rather than merged with a first one still pending.
int count_signals(const char* ready, const char* log_path) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigprocmask(SIG_BLOCK, &set, nullptr);
  const int log = open(log_path, O_WRONLY | O_CREAT | O_APPEND, 0600);
  const int touched = open(ready, O_WRONLY | O_CREAT, 0600);
  if (log < 0 || touched < 0) return 2;
  close(touched);
  for (;;) {
    const int sig = sigwaitinfo(&set, nullptr);
    if (sig == SIGINT) (void)!write(log, "INT\n", 4);
    if (sig == SIGTERM) {
      (void)!write(log, "TERM\n", 5);
      return 0;
    }
  }
}

std::int64_t monotonic_ns() {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<std::int64_t>(now.tv_sec) * 1000000000LL + now.tv_nsec;
}

bool stamp(const char* path) {
  const auto now = monotonic_ns();
  FILE* out = std::fopen(path, "w");
  if (!out) return false;
  std::fprintf(out, "%lld\n", static_cast<long long>(now));
  return std::fclose(out) == 0;
}

int beat(const char* log_path) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigprocmask(SIG_BLOCK, &set, nullptr);
  const int log = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (log < 0) return 2;
  const timespec period{0, 5'000'000};
  for (;;) {
    // One write per line: lines never interleave or tear.
    char line[32];
    const int sig = sigtimedwait(&set, nullptr, &period);
    if (sig == SIGINT) return 0;
    const int n = std::snprintf(line, sizeof line, "%c %lld\n", sig == SIGTERM ? 'T' : 'B',
                                static_cast<long long>(monotonic_ns()));
    if (write(log, line, static_cast<std::size_t>(n)) != n) return 2;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "fds") == 0) return list_descriptors(argv[2]);
  if (argc == 4 && std::strcmp(argv[1], "count-signals") == 0) return count_signals(argv[2], argv[3]);
  if (argc == 3 && std::strcmp(argv[1], "stamp") == 0) return stamp(argv[2]) ? 0 : 2;
  if (argc == 3 && std::strcmp(argv[1], "beat") == 0) return beat(argv[2]);
  if (argc >= 4 && std::strcmp(argv[1], "hostname") == 0) {
    const std::string name = unescape(argv[2]);
    if (unshare(CLONE_NEWUTS) != 0 || sethostname(name.data(), name.size()) != 0) {
      std::perror("cli_probe_child: cannot set a host name in a namespace of its own");
      return 77;
    }
    execv(argv[3], argv + 3);
    std::perror("cli_probe_child: exec");
    return 127;
  }
  std::fprintf(stderr,
               "usage: cli_probe_child fds OUT | count-signals READY LOG | stamp FILE | "
               "beat LOG | hostname NAME COMMAND...\n");
  return 2;
}
