// SPDX-License-Identifier: Apache-2.0
// How the cost of a hold grows, on any backend URL (bench/all.py runs it per backend):
//
//   turnstile_bench_growth holds URL N [BUDGET_SECONDS]
//     one client, one thread, N Mutexes on N names, all held at once: time per lock() (the N
//     taken one after the other), RSS and open descriptors per hold, time per unlock(). With a
//     budget, taking holds stops once it is spent ("held" < N, and an "error" saying so).
//   turnstile_bench_growth waiters URL W
//     one Mutex held by the main thread; W threads, each with its own Mutex on the same name,
//     queue behind it; then the main thread unlocks and the W go through one by one. RSS per
//     waiter (the thread's own cost measured apart: the W threads first wait idle), and the time
//     per handoff while the queue drains.
//
// Prints one JSON object; on an error, the step reached and the error text ("error"), exit 1.
// The descriptor limit is raised first (file:// holds keep descriptors; see raise_descriptor_limit).
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include <turnstile/turnstile.hpp>

#include "process_stats.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// -1 when /proc/self/fd cannot be opened (every descriptor in use: the limit was the error).
long open_descriptors() { return proc_entries("/proc/self/fd"); }

int holds(const std::string& url, long n, double budget_seconds) {
  auto client = turnstile::Client::connect(url);
  auto warm = client.mutex("bench/growth/warm");  // the first hold's one-time set-up, untimed
  warm.lock();
  warm.unlock();
  std::vector<turnstile::Mutex> mutexes;
  mutexes.reserve(static_cast<std::size_t>(n));
  for (long i = 0; i < n; ++i) mutexes.push_back(client.mutex("bench/growth/" + std::to_string(i)));
  const long rss_before = rss_kib();
  const long fds_before = open_descriptors();
  long held = 0;
  std::string error;
  const auto start = Clock::now();
  try {
    for (; held < n; ++held) {
      if (budget_seconds > 0 && seconds_since(start) > budget_seconds) {
        error = "stopped after the time budget of " + std::to_string(static_cast<int>(budget_seconds)) + " s";
        break;
      }
      mutexes[static_cast<std::size_t>(held)].lock();
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  const double lock_seconds = seconds_since(start);
  if (error.rfind("stopped", 0) != 0 && !error.empty() && held > 0)
    mutexes[static_cast<std::size_t>(--held)].unlock();  // room to measure
  const long rss_held = rss_kib();
  const long fds_held = open_descriptors();
  const auto unlock_start = Clock::now();
  for (long i = 0; i < held; ++i) mutexes[static_cast<std::size_t>(i)].unlock();
  const double unlock_seconds = seconds_since(unlock_start);
  const double per = held > 0 ? static_cast<double>(held) : 1.0;
  const std::string fds_per_hold =
      fds_held < 0 ? "null" : std::to_string(static_cast<double>(fds_held - fds_before) / per);
  std::printf(
      "{\"mode\":\"holds\",\"names\":%ld,\"held\":%ld,\"lock_us_per_hold\":%.2f,\"unlock_us_per_hold\":%.2f,"
      "\"kib_per_hold\":%.2f,\"fds_per_hold\":%s,\"rss_kib_held\":%ld%s%s}\n",
      n, held, lock_seconds * 1e6 / per, unlock_seconds * 1e6 / per, static_cast<double>(rss_held - rss_before) / per,
      fds_per_hold.c_str(), rss_held,
      error.empty() ? "" : ",\"error\":", error.empty() ? "" : json_string(error).c_str());
  return error.empty() ? 0 : 1;
}

// Waits (bounded) until `counter` reaches `target`.
void wait_for(const std::atomic<long>& counter, long target) {
  const auto give_up = Clock::now() + std::chrono::seconds(120);
  while (counter.load() < target && Clock::now() < give_up) std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

int waiters(const std::string& url, long w) {
  auto client = turnstile::Client::connect(url);
  auto holder = client.mutex("bench/growth/one");
  holder.lock();
  std::promise<void> go_promise;
  std::shared_future<void> go = go_promise.get_future().share();
  std::atomic<long> started{0}, queued{0}, acquired{0}, failed{0};
  std::vector<std::thread> threads;
  for (long i = 0; i < w; ++i) {
    threads.emplace_back([&] {
      auto mutex = client.mutex("bench/growth/one");
      ++started;
      go.wait();
      ++queued;
      try {
        mutex.lock();
        mutex.unlock();
        ++acquired;
      } catch (const std::exception& e) {
        if (failed++ == 0) std::fprintf(stderr, "waiter: %s\n", e.what());
      }
    });
  }
  wait_for(started, w);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const long rss_idle = rss_kib();
  go_promise.set_value();
  wait_for(queued, w);
  // No backend-neutral "queued" signal: let every waiter reach the server (its request, its
  // watch), 1 ms per waiter on top of 300 ms, then measure.
  std::this_thread::sleep_for(std::chrono::milliseconds(300 + w));
  const long rss_queued = rss_kib();
  const long acquired_early = acquired.load();  // must be 0: the holder still holds
  const auto start = Clock::now();
  holder.unlock();
  for (auto& thread : threads) thread.join();
  const double drain = seconds_since(start);
  std::printf(
      "{\"mode\":\"waiters\",\"waiters\":%ld,\"acquired\":%ld,\"acquired_while_held\":%ld,\"failed\":%ld,"
      "\"kib_per_waiter\":%.2f,\"handoff_us\":%.2f,\"rss_kib_queued\":%ld}\n",
      w, acquired.load(), acquired_early, failed.load(),
      static_cast<double>(rss_queued - rss_idle) / static_cast<double>(w), drain * 1e6 / static_cast<double>(w),
      rss_queued);
  return failed.load() == 0 && acquired_early == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4 || argc > 5 || (std::strcmp(argv[1], "holds") != 0 && std::strcmp(argv[1], "waiters") != 0)) {
    std::fprintf(stderr, "usage: %s holds URL N [BUDGET_SECONDS] | waiters URL N\n", argv[0]);
    return 64;
  }
  raise_descriptor_limit();
  const long n = std::atol(argv[3]);
  try {
    return std::strcmp(argv[1], "holds") == 0 ? holds(argv[2], n, argc > 4 ? std::atof(argv[4]) : 0.0)
                                              : waiters(argv[2], n);
  } catch (const std::exception& e) {
    std::printf("{\"mode\":%s,\"error\":%s}\n", json_string(argv[1]).c_str(), json_string(e.what()).c_str());
    return 1;
  }
}
