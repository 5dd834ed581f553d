// SPDX-License-Identifier: Apache-2.0
// `turnstile demo parking`: cars are processes, the parking lot is a Semaphore with one lease
// per space. Every car records its hold; at the end the history is checked for a moment with
// more cars parked than spaces.
//
// The parent never builds a Client before forking (a Client must not cross fork(), and a
// process with threads should not fork children that go on running C++): each car connects
// on its own, and the URL is checked up front in a short-lived probe process.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <new>
#include <random>
#include <thread>

#include "commands.hpp"
#include "common.hpp"
#include "testing/hold_history.hpp"

namespace turnstile::cli {
namespace {

constexpr const char* kLotName = "demo/parking";
constexpr std::int64_t kMaxCount = 1000;

// Shared by all cars through an anonymous shared mapping: who is parked where, for the
// timeline only (the proof is the recorded history, not these counters).
struct Lot {
  std::atomic<int> parked{0};
  std::atomic<int> space_owner[kMaxCount];  // 0 = free, else car number
};

struct Timeline {
  std::int64_t start_ns;
  // One write(2) per line, so lines of concurrent cars never interleave.
  void say(int car, const char* format, ...) const __attribute__((format(printf, 3, 4))) {
    char line[256];
    const double ms = static_cast<double>(testing::monotonic_ns() - start_ns) / 1e6;
    int n = std::snprintf(line, sizeof line, "%7.1f ms  car %3d  ", ms, car);
    va_list args;
    va_start(args, format);
    n += std::vsnprintf(line + n, sizeof line - n, format, args);
    va_end(args);
    n = std::min<int>(n, sizeof line - 2);
    line[n++] = '\n';
    (void)!write(STDOUT_FILENO, line, n);
  }
};

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

// One car, in its own process: arrive, wait for a space, park, leave.
int drive(int car, const std::string& url, std::int64_t spaces, const std::string& history, Lot& lot,
          const Timeline& timeline) {
  std::mt19937 random(static_cast<unsigned>(timeline.start_ns) ^ (static_cast<unsigned>(car) * 2654435761u));
  sleep_ms(std::uniform_int_distribution(0, 300)(random));
  try {
    auto client = Client::connect(url);
    auto semaphore = client.semaphore(kLotName, spaces);
    testing::FileHoldRecorder recorder(history);
    timeline.say(car, "arrives");
    const auto request_ns = testing::monotonic_ns();
    Lease lease = semaphore.acquire();
    const auto start_ns = testing::monotonic_ns();
    int space = 0;
    for (int s = 0; s < spaces && space == 0; ++s) {
      int free = 0;
      if (lot.space_owner[s].compare_exchange_strong(free, car)) space = s + 1;
    }
    const int parked = ++lot.parked;
    if (space == 0) {
      timeline.say(car, "finds no free space! (fencing token %llu), %d parked",
                   static_cast<unsigned long long>(lease.fencing_token()), parked);
    } else {
      timeline.say(car, "parks in space %d (fencing token %llu), %d parked", space,
                   static_cast<unsigned long long>(lease.fencing_token()), parked);
    }
    sleep_ms(std::uniform_int_distribution(100, 400)(random));
    const int left = --lot.parked;
    if (space != 0) lot.space_owner[space - 1] = 0;
    timeline.say(car, "leaves, %d parked", left);
    const auto end_ns = testing::monotonic_ns();
    recorder.record({kLotName, "lease", 1, lease.fencing_token(), start_ns, end_ns, request_ns});
    lease.release();
    return 0;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "turnstile: car %d: %s\n", car, error.what());
    return 1;
  }
}

// Forks a process running `body` that dies with us; returns its pid, or -1.
template <class Body>
pid_t spawn(Body body) {
  std::fflush(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid != 0) return pid;
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(1);
  const int status = body();
  std::fflush(nullptr);
  _exit(status);
}

int wait_status(pid_t pid) {
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// A bad URL or an unusable backend is reported once, with the usual status, instead of per car.
// The probe, a car-like child, also hands back the URL as the library shows it (credentials
// redacted) in `shown_url`. Returns 0 when the backend answered.
int probe_backend(const std::string& url, std::string& shown_url) {
  int url_pipe[2];
  if (pipe2(url_pipe, O_CLOEXEC) != 0) {
    complain(describe_errno("pipe"));
    return kExitOsError;
  }
  const pid_t probe = spawn([&] {
    close(url_pipe[0]);
    try {
      const auto client = Client::connect(url);
      (void)!write(url_pipe[1], client.url().data(), client.url().size());
      return 0;
    } catch (const Error& error) {
      complain(error.what());
      return exit_status_for(error);
    }
  });
  close(url_pipe[1]);
  char buffer[512];
  for (ssize_t n; (n = read(url_pipe[0], buffer, sizeof buffer)) != 0;) {
    if (n > 0) shown_url.append(buffer, static_cast<std::size_t>(n));
    else if (errno != EINTR) break;
  }
  close(url_pipe[0]);
  if (probe < 0) {
    complain(describe_errno("fork"));
    return kExitOsError;
  }
  return wait_status(probe);
}

// Starts every car and waits for them; how many failed (or could not start).
int drive_cars(const ParkingOptions& options, const std::string& url, const std::string& history, Lot& lot,
               const Timeline& timeline) {
  std::vector<pid_t> cars;
  int failed = 0;
  for (int car = 1; car <= options.cars; ++car) {
    const pid_t pid = spawn([&] { return drive(car, url, options.spaces, history, lot, timeline); });
    if (pid < 0) {
      complain(describe_errno("fork"));
      ++failed;
      break;
    }
    cars.push_back(pid);
  }
  for (pid_t pid : cars) failed += wait_status(pid) != 0;
  return failed;
}

// Checks the cars' recorded stays and says whether the lot was shared soundly; the exit status.
int verdict(const ParkingOptions& options, const std::string& history, int failed) {
  const auto records = testing::load_history(history);
  const auto violations = testing::check(records, options.spaces);
  const auto peak = testing::max_concurrency(records, kLotName);
  if (!violations.empty()) {
    std::printf("peak %lld of %lld spaces used; the history is NOT sound:\n%s\n", static_cast<long long>(peak),
                static_cast<long long>(options.spaces), testing::describe(violations).c_str());
    return 1;
  }
  if (failed > 0) {
    std::printf("%d of %lld cars failed\n", failed, static_cast<long long>(options.cars));
    return 1;
  }
  if (records.size() != static_cast<std::size_t>(options.cars)) {
    std::printf("only %zu of %lld cars recorded their stay\n", records.size(), static_cast<long long>(options.cars));
    return 1;
  }
  std::printf("peak %lld of %lld spaces used; history sound\n", static_cast<long long>(peak),
              static_cast<long long>(options.spaces));
  return 0;
}

int run_demo(const ParkingOptions& options, const std::string& url, const std::string& history) {
  std::string shown_url;
  if (const int status = probe_backend(url, shown_url); status != 0) return status;

  void* memory = mmap(nullptr, sizeof(Lot), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (memory == MAP_FAILED) {
    complain(describe_errno("mmap"));
    return kExitOsError;
  }
  auto* lot = new (memory) Lot;
  const Timeline timeline{testing::monotonic_ns()};
  std::printf("%lld cars, %lld spaces (Semaphore '%s' on %s)\n", static_cast<long long>(options.cars),
              static_cast<long long>(options.spaces), kLotName, shown_url.c_str());
  const int failed = drive_cars(options, url, history, *lot, timeline);
  munmap(memory, sizeof(Lot));
  return verdict(options, history, failed);
}

}  // namespace

int parking_demo(const ParkingOptions& options) {
  if (options.cars < 1 || options.cars > kMaxCount) {
    complain("--cars must be between 1 and " + std::to_string(kMaxCount));
    return kExitUsage;
  }
  if (options.spaces < 1 || options.spaces > kMaxCount) {
    complain("--spaces must be between 1 and " + std::to_string(kMaxCount));
    return kExitUsage;
  }
  // A fresh private directory per run, so runs never see each other's lot (or tokens).
  char dir_template[] = "/tmp/turnstile-parking-XXXXXX";
  if (!mkdtemp(dir_template)) {
    complain(std::string("mkdtemp: ") + std::strerror(errno));
    return kExitOsError;
  }
  const std::string dir = dir_template;
  const std::string url = options.backend ? *options.backend : "file://" + dir + "/lot";
  int status;
  try {
    status = run_demo(options, url, dir + "/history");
  } catch (const std::exception& error) {
    complain(error.what());
    status = 1;
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  return status;
}

}  // namespace turnstile::cli
