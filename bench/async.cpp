// SPDX-License-Identifier: Apache-2.0
// Async acquires against their blocking counterparts, on any backend URL (issue 26; bench/all.py
// runs it per backend):
//
//   turnstile_bench_async pairs URL SECONDS [ROUNDS]
//     one client, one name, nobody else: `co_await mutex.lock_async()` + Lease::release(),
//     against mutex.lock() + mutex.unlock(), each for SECONDS per round, their order swapped
//     from round to round (5 rounds by default). Pairs per second of each, and async ÷ blocking
//     per round (the median too: issue 26 asks for it within 5 %).
//   turnstile_bench_async waiters URL N
//     one held name, N lock_async() queued behind it by one client: this process's threads before
//     and with them queued, RSS per waiting acquire, the time to queue them, then the time per
//     handoff while the queue drains (each admitted acquire's callback drops its Lease at once).
//   turnstile_bench_async count URL blocking|async N
//     N pairs of one kind after the warm-up, nothing else: run it under `perf stat -e
//     instructions` or `valgrind --tool=callgrind` for N and for 0, and the difference over N is
//     the instructions per pair (robust on a loaded machine, where pairs per second are not).
//
// Prints one JSON object; on an error, the error text ("error"), exit 1.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <coroutine>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <turnstile/async.hpp>
#include <turnstile/turnstile.hpp>

#include "process_stats.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const auto mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : (values[mid - 1] + values[mid]) / 2;
}

// ---- pairs -------------------------------------------------------------------------------

double blocking_pairs(turnstile::Mutex& mutex, double seconds) {
  for (int i = 0; i < 200; ++i) {  // warm-up, as bench/per_second.hpp
    mutex.lock();
    mutex.unlock();
  }
  long count = 0;
  const auto start = Clock::now();
  while (seconds_since(start) < seconds) {
    mutex.lock();
    mutex.unlock();
    ++count;
  }
  return static_cast<double>(count) / seconds_since(start);
}

// A minimal coroutine type: starts at once, frees itself at the end; the caller learns of the
// end through `done`.
struct Loop {
  struct promise_type {
    Loop get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
};

struct LoopResult {
  std::mutex mutex;
  std::condition_variable changed;
  bool done = false;
  double per_second = 0;
  std::string error;
};

// Pairs for `seconds`, or exactly `pairs` of them when given.
Loop async_loop(turnstile::Mutex& mutex, double seconds, LoopResult& result, std::optional<long> pairs = {}) {
  double rate = 0;
  std::string error;
  try {
    for (int i = 0; i < 200; ++i) (void)co_await mutex.lock_async();  // warm-up
    long count = 0;
    const auto start = Clock::now();
    while (pairs ? count < *pairs : seconds_since(start) < seconds) {
      auto lease = co_await mutex.lock_async();
      if (!lease) throw std::runtime_error("an uncontended lock_async() acquired nothing");
      // The unlock: release() waits for the server's answer, as unlock() does (a Lease's end
      // would release without waiting, in the background: not the same work).
      lease->release();
      ++count;
    }
    rate = static_cast<double>(count) / seconds_since(start);
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::lock_guard lock(result.mutex);
  result.per_second = rate;
  result.error = error;
  result.done = true;
  result.changed.notify_all();
}

double async_pairs(turnstile::Mutex& mutex, double seconds, std::optional<long> pairs = {}) {
  LoopResult result;
  async_loop(mutex, seconds, result, pairs);
  std::unique_lock lock(result.mutex);
  result.changed.wait(lock, [&] { return result.done; });
  if (!result.error.empty()) throw std::runtime_error(result.error);
  return result.per_second;
}

int pairs(const std::string& url, double seconds, int rounds) {
  auto client = turnstile::Client::connect(url);
  auto mutex = client.mutex("bench/async/pairs");
  std::vector<double> blocking, async, ratios;
  for (int round = 0; round < rounds; ++round) {
    double b = 0, a = 0;
    if (round % 2 == 0) {
      b = blocking_pairs(mutex, seconds);
      a = async_pairs(mutex, seconds);
    } else {
      a = async_pairs(mutex, seconds);
      b = blocking_pairs(mutex, seconds);
    }
    blocking.push_back(b);
    async.push_back(a);
    ratios.push_back(b > 0 ? a / b : 0);
  }
  std::string per_round;
  for (const double r : ratios) per_round += (per_round.empty() ? "" : ",") + std::to_string(r);
  std::printf(
      "{\"mode\":\"pairs\",\"rounds\":%d,\"seconds\":%.2f,\"blocking_per_second\":%.1f,\"async_per_second\":%.1f,"
      "\"async_over_blocking\":%.4f,\"ratio_per_round\":[%s]}\n",
      rounds, seconds, median(blocking), median(async), median(ratios), per_round.c_str());
  return 0;
}

int count(const std::string& url, const std::string& kind, long pairs) {
  auto client = turnstile::Client::connect(url);
  auto mutex = client.mutex("bench/async/pairs");
  if (kind == "async") {
    async_pairs(mutex, 0, pairs);
  } else {
    for (long i = 0; i < 200 + pairs; ++i) {
      mutex.lock();
      mutex.unlock();
    }
  }
  std::printf("{\"mode\":\"count\",\"kind\":%s,\"pairs\":%ld}\n", json_string(kind).c_str(), pairs);
  return 0;
}

// ---- waiters -----------------------------------------------------------------------------

struct Drain {
  std::mutex mutex;
  std::condition_variable changed;
  long ended = 0;
  long acquired = 0;
  long failed = 0;
};

int waiters(const std::string& url, long n) {
  Drain drain;  // before the client: the client's end ends the acquires still pending
  auto client = turnstile::Client::connect(url);
  const std::string name = "bench/async/waiters";
  {  // the pool and the backend's I/O threads start before the count
    auto warm = client.mutex(name);
    (void)warm.lock_async().get();
  }
  // The holder has a client of its own: on etcd a client's own holder and waiters share one
  // turn on the name inside the client, and none of them would wait on the server.
  auto holder_client = turnstile::Client::connect(url);
  auto holder = holder_client.mutex(name);
  holder.lock();
  std::deque<turnstile::Mutex> mutexes;
  const long threads_before = proc_entries("/proc/self/task");
  const long rss_before = rss_kib();
  const auto queue_start = Clock::now();
  for (long i = 0; i < n; ++i) {
    mutexes.push_back(client.mutex(name));
    // The callback drops the Lease as it returns: that release admits the next in line.
    mutexes.back().lock_async().then([&drain](auto done) {
      bool held = false, failed = false;
      try {
        held = done.get().has_value();
      } catch (const std::exception&) {
        failed = true;
      }
      std::lock_guard lock(drain.mutex);
      ++drain.ended;
      drain.acquired += held;
      drain.failed += failed;
      drain.changed.notify_all();
    });
  }
  // Every acquire queued: inspect shows them (bounded: 10 minutes). On etcd a client's waiters
  // on one name line up inside the client (one key per lease and name): the server shows one.
  const std::size_t visible = url.rfind("etcd", 0) == 0 ? 1 : static_cast<std::size_t>(n);
  const auto give_up = Clock::now() + std::chrono::minutes(10);
  while (client.inspect(name).waiters.size() < visible && Clock::now() < give_up)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const double queue_seconds = seconds_since(queue_start);
  const long threads_queued = proc_entries("/proc/self/task");
  const long rss_queued = rss_kib();
  const long acquired_early = [&] {
    std::lock_guard lock(drain.mutex);
    return drain.acquired;
  }();
  const auto drain_start = Clock::now();
  holder.unlock();
  {
    std::unique_lock lock(drain.mutex);
    drain.changed.wait_until(lock, Clock::now() + std::chrono::minutes(10), [&] { return drain.ended == n; });
  }
  const double drain_seconds = seconds_since(drain_start);
  std::lock_guard lock(drain.mutex);
  std::printf(
      "{\"mode\":\"waiters\",\"waiters\":%ld,\"acquired\":%ld,\"acquired_while_held\":%ld,\"failed\":%ld,"
      "\"threads_before\":%ld,\"threads_queued\":%ld,\"kib_per_waiter\":%.2f,\"queue_seconds\":%.2f,"
      "\"handoff_us\":%.1f,\"rss_kib_queued\":%ld}\n",
      n, drain.acquired, acquired_early, drain.failed, threads_before, threads_queued,
      static_cast<double>(rss_queued - rss_before) / static_cast<double>(n), queue_seconds,
      drain_seconds * 1e6 / static_cast<double>(n), rss_queued);
  return drain.failed == 0 && acquired_early == 0 && drain.acquired == n ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const bool is_pairs = argc >= 4 && argc <= 5 && std::strcmp(argv[1], "pairs") == 0;
  const bool is_waiters = argc == 4 && std::strcmp(argv[1], "waiters") == 0;
  const bool is_count = argc == 5 && std::strcmp(argv[1], "count") == 0 &&
                        (std::strcmp(argv[3], "async") == 0 || std::strcmp(argv[3], "blocking") == 0);
  if (!is_pairs && !is_waiters && !is_count) {
    std::fprintf(stderr, "usage: %s pairs URL SECONDS [ROUNDS] | waiters URL N | count URL blocking|async N\n",
                 argv[0]);
    return 64;
  }
  raise_descriptor_limit();
  try {
    if (is_count) return count(argv[2], argv[3], std::atol(argv[4]));
    return is_pairs ? pairs(argv[2], std::atof(argv[3]), argc > 4 ? std::atoi(argv[4]) : 5)
                    : waiters(argv[2], std::atol(argv[3]));
  } catch (const std::exception& e) {
    std::printf("{\"mode\":%s,\"error\":%s}\n", json_string(argv[1]).c_str(), json_string(e.what()).c_str());
    return 1;
  }
}
