// SPDX-License-Identifier: Apache-2.0
// Uncontended acquire/release of each primitive on the embedded file:// backend, next to a bare
// flock(2) LOCK_EX/LOCK_UN pair on one open file, in the same run.
//
//   turnstile_bench_uncontended [google benchmark flags]
//
// Each benchmark works in its own fresh mkdtemp directory (removed at the end). bench/run.sh
// runs this three times and reports the median Mutex/flock ratio.
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

#include <turnstile/turnstile.hpp>

namespace {

// A fresh directory under $TMPDIR (default /tmp), removed when the benchmark ends.
class FreshDir {
 public:
  FreshDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/turnstile-bench-XXXXXX";
    if (!mkdtemp(pattern.data())) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~FreshDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }
  std::string url() const { return "file://" + path_; }

 private:
  std::string path_;
};

void BM_FlockPair(benchmark::State& state) {
  FreshDir dir;
  const int fd = open((dir.path() + "/lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    state.SkipWithError("open failed");
    return;
  }
  for (auto _ : state) {
    flock(fd, LOCK_EX);
    flock(fd, LOCK_UN);
  }
  close(fd);
}

void BM_Mutex(benchmark::State& state) {
  FreshDir dir;
  auto client = turnstile::Client::connect(dir.url());
  auto mutex = client.mutex("bench/mutex");
  mutex.lock();  // the first use creates the state file: keep it out of the timing
  mutex.unlock();
  for (auto _ : state) {
    mutex.lock();
    mutex.unlock();
  }
}

void BM_RecursiveMutex(benchmark::State& state) {
  FreshDir dir;
  auto client = turnstile::Client::connect(dir.url());
  auto mutex = client.recursive_mutex("bench/recursive");
  mutex.lock();
  mutex.unlock();
  for (auto _ : state) {
    mutex.lock();
    mutex.unlock();
  }
}

void BM_SharedMutexShared(benchmark::State& state) {
  FreshDir dir;
  auto client = turnstile::Client::connect(dir.url());
  auto rw = client.shared_mutex("bench/shared");
  rw.lock_shared();
  rw.unlock_shared();
  for (auto _ : state) {
    rw.lock_shared();
    rw.unlock_shared();
  }
}

void BM_SharedMutexExclusive(benchmark::State& state) {
  FreshDir dir;
  auto client = turnstile::Client::connect(dir.url());
  auto rw = client.shared_mutex("bench/shared");
  rw.lock();
  rw.unlock();
  for (auto _ : state) {
    rw.lock();
    rw.unlock();
  }
}

void BM_Semaphore(benchmark::State& state) {
  FreshDir dir;
  auto client = turnstile::Client::connect(dir.url());
  auto semaphore = client.semaphore("bench/semaphore", 4);
  semaphore.acquire();  // Lease released at once
  for (auto _ : state) {
    turnstile::Lease lease = semaphore.acquire();
    lease.release();
  }
}

void BM_PermitCounter(benchmark::State& state) {
  FreshDir dir;
  auto client = turnstile::Client::connect(dir.url());
  auto permits = client.permit_counter("bench/permits");
  permits.try_set_permits(4);
  for (auto _ : state) {
    permits.acquire();
    permits.release();
  }
}

}  // namespace

// Real time throughout: the client has background threads, and the comparison is wall time.
BENCHMARK(BM_FlockPair)->UseRealTime();
BENCHMARK(BM_Mutex)->UseRealTime();
BENCHMARK(BM_RecursiveMutex)->UseRealTime();
BENCHMARK(BM_SharedMutexShared)->UseRealTime();
BENCHMARK(BM_SharedMutexExclusive)->UseRealTime();
BENCHMARK(BM_Semaphore)->UseRealTime();
BENCHMARK(BM_PermitCounter)->UseRealTime();

BENCHMARK_MAIN();
