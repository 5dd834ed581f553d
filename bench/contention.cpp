// SPDX-License-Identifier: Apache-2.0
// N processes contending for one lock: turnstile's Mutex (on file://, or on any backend URL)
// versus a bare flock(2); and N processes contending for a turnstile Semaphore.
//
//   turnstile_bench_contention (turnstile|flock) [--procs 8] [--seconds 2] [--dir DIR] [--url URL]
//                              [--cdf FILE]
//   turnstile_bench_contention semaphore [--limit 3] [--procs 16] [--seconds 2] [--url URL]
//
// --url picks the turnstile backend (say redis://127.0.0.1:6379); the default is file://DIR,
// with DIR a fresh directory. flock always uses DIR.
//
// The parent forks the children before it creates any thread or Client; each child connects on
// its own (or opens the lock file on its own, for flock: one open file description each) and
// then loops lock / record / unlock with an empty critical section until the period ends.
//
// Every holder appends a record to a shared anonymous mapping, indexed by a counter it bumps
// while holding the lock, so records are in hold order (for turnstile that is also fencing-token
// order): {pid, start = first instant after lock() returned, end = last instant before unlock()},
// CLOCK_MONOTONIC. Handoff latency is next.start - previous.end. Only holds that started within
// the period count. Prints one JSON object. --cdf FILE also writes the handoff latencies to
// another process as a JSON array of 201 quantiles (0, 0.5 %, ..., 100 %), in ns, for a CDF plot.
//
// semaphore: each child loops acquire / record / release on one Semaphore(limit). Holds overlap,
// so there is no hold order and no handoff latency: the output is the acquisition rate, plus
// the most holders seen at once (must not exceed the limit).
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <turnstile/turnstile.hpp>

namespace {

std::int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return std::int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

struct Record {
  std::int64_t start;
  std::int64_t end;
  std::int32_t pid;
  std::uint32_t token;  // turnstile: low bits of the fencing token, to check the order
};

struct Shared {
  std::atomic<std::uint64_t> next;  // bumped only under the lock
  std::atomic<std::int64_t> start_ns;
  std::atomic<std::int64_t> end_ns;
  std::atomic<int> failed;
  std::atomic<int> holders;      // semaphore: holders right now
  std::atomic<int> max_holders;  // semaphore: the most seen at once
};

constexpr std::size_t kCapacity = 8u << 20;  // records; pages are only touched when used

Shared* shared;
Record* records;

void die(const char* what) {
  std::perror(what);
  std::_Exit(2);
}

// Fills record i for a hold that started at `start`: false once the period is over or the
// record area is full.
bool fill_record(std::uint64_t i, std::int64_t start, std::uint64_t token) {
  if (i >= kCapacity) return false;
  records[i].start = start;
  records[i].pid = getpid();
  records[i].token = static_cast<std::uint32_t>(token);
  records[i].end = now_ns();  // the last instant before unlock()
  return start < shared->end_ns.load(std::memory_order_relaxed);
}

// One exclusive hold: the lock orders the bumps, so no atomic read-modify-write is needed.
bool record_hold(std::int64_t start, std::uint64_t token) {
  const auto i = shared->next.load(std::memory_order_relaxed);
  shared->next.store(i + 1, std::memory_order_relaxed);
  return fill_record(i, start, token);
}

// Runs a child's loop; an error is reported on stderr and in the shared block.
template <class Body>
int run_child(Body body) {
  try {
    body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "child %d: %s\n", getpid(), e.what());
    shared->failed = 1;
    return 1;
  }
  return 0;
}

void wait_for_go(int ready_fd, int go_fd) {
  char byte = 'r';
  if (write(ready_fd, &byte, 1) != 1) die("write");
  if (read(go_fd, &byte, 1) != 0) die("read go");  // returns 0 when the parent closes it
}

int child_turnstile(const std::string& url, int ready_fd, int go_fd) {
  return run_child([&] {
    auto client = turnstile::Client::connect(url);
    auto mutex = client.mutex("bench/contended");
    wait_for_go(ready_fd, go_fd);
    for (;;) {
      mutex.lock();
      const std::int64_t start = now_ns();
      const bool more = record_hold(start, mutex.fencing_token());
      mutex.unlock();
      if (!more) break;
    }
  });
}

int child_semaphore(const std::string& url, std::int64_t limit, int ready_fd, int go_fd) {
  return run_child([&] {
    auto client = turnstile::Client::connect(url);
    auto semaphore = client.semaphore("bench/contended-semaphore", limit);
    wait_for_go(ready_fd, go_fd);
    for (;;) {
      turnstile::Lease lease = semaphore.acquire();
      const std::int64_t start = now_ns();
      const int holders = shared->holders.fetch_add(1) + 1;
      for (int seen = shared->max_holders.load();
           holders > seen && !shared->max_holders.compare_exchange_weak(seen, holders);) {
      }
      // Several holders at once: an atomic bump.
      const bool more = fill_record(shared->next.fetch_add(1), start, lease.fencing_token());
      shared->holders.fetch_sub(1);
      lease.release();
      if (!more) break;
    }
  });
}

int child_flock(const std::string& dir, int ready_fd, int go_fd) {
  const int fd = open((dir + "/flock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) die("open");
  wait_for_go(ready_fd, go_fd);
  for (;;) {
    if (flock(fd, LOCK_EX) != 0) die("flock");
    const std::int64_t start = now_ns();
    const bool more = record_hold(start, 0);
    flock(fd, LOCK_UN);
    if (!more) break;
  }
  return 0;
}

double percentile(std::vector<std::int64_t>& v, double p) {
  if (v.empty()) return 0;
  const auto k = static_cast<std::size_t>(p * static_cast<double>(v.size() - 1) + 0.5);
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return static_cast<double>(v[k]);
}

// The 201 quantiles of v (sorted in place) as one JSON array, for bench/all.py's CDF plot.
void write_quantiles(const std::string& file, std::vector<std::int64_t>& v) {
  FILE* out = std::fopen(file.c_str(), "w");
  if (!out) die("fopen --cdf");
  std::sort(v.begin(), v.end());
  std::fputc('[', out);
  for (int q = 0; q <= 200 && !v.empty(); ++q) {
    const auto k = static_cast<std::size_t>(q / 200.0 * static_cast<double>(v.size() - 1) + 0.5);
    std::fprintf(out, "%s%lld", q ? "," : "", static_cast<long long>(v[k]));
  }
  std::fputs("]\n", out);
  std::fclose(out);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || (std::strcmp(argv[1], "turnstile") != 0 && std::strcmp(argv[1], "flock") != 0 &&
                   std::strcmp(argv[1], "semaphore") != 0)) {
    std::fprintf(stderr,
                 "usage: %s (turnstile|flock) [--procs N] [--seconds S] [--dir DIR] [--url URL]\n"
                 "       %s semaphore [--limit N] [--procs N] [--seconds S] [--dir DIR] [--url URL]\n",
                 argv[0], argv[0]);
    return 64;
  }
  const bool use_flock = std::strcmp(argv[1], "flock") == 0;
  const bool use_semaphore = std::strcmp(argv[1], "semaphore") == 0;
  int procs = use_semaphore ? 16 : 8;
  std::int64_t limit = 3;
  double seconds = 2.0;
  std::string dir, url, cdf_file;
  for (int i = 2; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--procs")) procs = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--seconds")) seconds = std::atof(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--dir")) dir = argv[i + 1];
    else if (!std::strcmp(argv[i], "--url")) url = argv[i + 1];
    else if (!std::strcmp(argv[i], "--limit")) limit = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--cdf")) cdf_file = argv[i + 1];
  }
  bool own_dir = false;
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/turnstile-contention-XXXXXX";
    if (!mkdtemp(pattern.data())) die("mkdtemp");
    dir = pattern;
    own_dir = true;
  }
  // The backend's name for the JSON (a URL has colons, which the summary's parser splits on).
  const std::string backend = use_flock ? "flock" : url.empty() ? "file" : url.substr(0, url.find(':'));
  if (url.empty()) url = "file://" + dir;

  void* area = mmap(nullptr, sizeof(Shared) + kCapacity * sizeof(Record), PROT_READ | PROT_WRITE,
                    MAP_SHARED | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (area == MAP_FAILED) die("mmap");
  shared = new (area) Shared{};
  records = reinterpret_cast<Record*>(static_cast<char*>(area) + sizeof(Shared));
  shared->end_ns = INT64_MAX;

  int ready[2], go[2];
  if (pipe(ready) != 0 || pipe(go) != 0) die("pipe");

  // Fork every child first: the parent has no thread and no Client at this point.
  std::vector<pid_t> children;
  for (int i = 0; i < procs; ++i) {
    const pid_t pid = fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
      close(ready[0]);
      close(go[1]);
      std::_Exit(use_flock       ? child_flock(dir, ready[1], go[0])
                 : use_semaphore ? child_semaphore(url, limit, ready[1], go[0])
                                 : child_turnstile(url, ready[1], go[0]));
    }
    children.push_back(pid);
  }
  close(ready[1]);
  close(go[0]);
  for (int i = 0; i < procs; ++i) {
    char byte;
    if (read(ready[0], &byte, 1) != 1) die("a child failed to start");
  }
  const std::int64_t start = now_ns();
  shared->start_ns = start;
  shared->end_ns = start + static_cast<std::int64_t>(seconds * 1e9);
  close(go[1]);  // go

  int status_failed = 0;
  for (const pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) status_failed = 1;
  }
  if (own_dir) {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  }

  const std::uint64_t total = std::min<std::uint64_t>(shared->next.load(), kCapacity);
  const std::int64_t end = shared->end_ns.load();
  const int failed = shared->failed.load() | status_failed;
  if (use_semaphore) {
    std::size_t n = 0;  // holds that started within the period; records are not in time order
    for (std::uint64_t i = 0; i < total; ++i) n += records[i].start < end;
    const double period = static_cast<double>(end - start) / 1e9;
    std::printf(
        "{\"mode\":\"semaphore\",\"backend\":\"%s\",\"procs\":%d,\"limit\":%lld,\"seconds\":%.3f,"
        "\"acquisitions\":%zu,\"per_second\":%.1f,\"max_holders\":%d,\"failed\":%d}\n",
        backend.c_str(), procs, static_cast<long long>(limit), period, n, static_cast<double>(n) / period,
        shared->max_holders.load(), failed);
    return failed;
  }
  std::size_t n = 0;  // holds that started within the period, a prefix in hold order
  while (n < total && records[n].start < end) ++n;
  std::vector<std::int64_t> handoff, cross;
  std::size_t same_process = 0, order_errors = 0;
  for (std::size_t i = 0; i + 1 < n; ++i) {
    const std::int64_t h = records[i + 1].start - records[i].end;
    handoff.push_back(h);
    if (records[i + 1].pid == records[i].pid) ++same_process;
    else cross.push_back(h);
    // Fencing tokens grow with each holder (by exactly 1 on file:// and redis://; etcd's
    // revisions and ZooKeeper's sequence numbers skip).
    if (!use_flock && records[i + 1].token <= records[i].token) ++order_errors;
    if (h < 0) ++order_errors;
  }
  if (!cdf_file.empty()) write_quantiles(cdf_file, cross);
  const double period = static_cast<double>(end - start) / 1e9;
  std::printf(
      "{\"mode\":\"%s\",\"backend\":\"%s\",\"procs\":%d,\"seconds\":%.3f,\"acquisitions\":%zu,\"per_second\":%.1f,"
      "\"handoff_p50_ns\":%.0f,\"handoff_p99_ns\":%.0f,\"cross_p50_ns\":%.0f,\"cross_p99_ns\":%.0f,"
      "\"same_process_share\":%.4f,\"order_errors\":%zu,\"failed\":%d}\n",
      use_flock ? "flock" : "turnstile", backend.c_str(), procs, period, n, static_cast<double>(n) / period,
      percentile(handoff, 0.50), percentile(handoff, 0.99), percentile(cross, 0.50), percentile(cross, 0.99),
      handoff.empty() ? 0.0 : static_cast<double>(same_process) / handoff.size(), order_errors, failed);
  return failed;
}
