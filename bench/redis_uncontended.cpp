// SPDX-License-Identifier: Apache-2.0
// Uncontended Mutex lock+unlock on the redis:// backend, next to two bare PING round trips on
// one hiredis connection (the floor: a lock and an unlock need a round trip each), in the
// same run against the same redis-server, and two EVALSHA round trips of an empty script.
//
//   turnstile_bench_redis_uncontended --url=redis://HOST:PORT [google benchmark flags]
//   turnstile_bench_redis_uncontended --url=redis://HOST:PORT --count-commands N
//
// (or TURNSTILE_BENCH_REDIS_URL instead of --url). BM_RedisMutex also reports, as counters,
// the server commands per lock+unlock from the INFO commandstats delta over its timed loop:
// commands_per_pair counts every call the server made, the redis.call()s inside the Lua
// scripts included (the INFO calls of the measurement itself excluded); evalsha_per_pair
// counts the EVALSHA calls alone.
//
// --count-commands N runs N more lock+unlock pairs under MONITOR (not timed: MONITOR slows the
// server) and prints one JSON object: the commands the client sent (what crossed the network)
// per pair, by name, and the calls made from inside scripts per pair. bench/run.sh runs both.
#include <benchmark/benchmark.h>
#include <hiredis/hiredis.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <turnstile/turnstile.hpp>

namespace {

std::string g_url;

struct HostPort {
  std::string host;
  int port = 6379;
};

// Only what tests/servers/redis.sh writes: redis://HOST:PORT (no password, database 0).
HostPort host_port(const std::string& url) {
  std::string rest = url.substr(url.find("://") == std::string::npos ? 0 : url.find("://") + 3);
  rest = rest.substr(0, rest.find_first_of("/?"));
  HostPort result;
  const auto colon = rest.rfind(':');
  result.host = rest.substr(0, colon);
  if (colon != std::string::npos) result.port = std::atoi(rest.c_str() + colon + 1);
  return result;
}

struct ContextFree {
  void operator()(redisContext* c) const { redisFree(c); }
};
using Context = std::unique_ptr<redisContext, ContextFree>;
struct ReplyFree {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyFree>;

Context connect_raw() {
  const auto where = host_port(g_url);
  Context context(redisConnect(where.host.c_str(), where.port));
  if (!context || context->err) {
    throw std::runtime_error("cannot connect to " + g_url + ": " + (context ? context->errstr : "out of memory"));
  }
  return context;
}

template <class... Args>
Reply command(redisContext* context, const char* text, Args... args) {
  Reply reply(static_cast<redisReply*>(redisCommand(context, text, args...)));
  if (!reply || reply->type == REDIS_REPLY_ERROR) throw std::runtime_error(std::string("redis ") + text + " failed");
  return reply;
}

// INFO commandstats as name -> calls.
std::map<std::string, long long> command_calls(redisContext* context) {
  const auto reply = command(context, "INFO commandstats");
  std::map<std::string, long long> calls;
  const std::string text(reply->str, reply->len);
  std::size_t at = 0;
  while ((at = text.find("cmdstat_", at)) != std::string::npos) {
    const auto colon = text.find(':', at);
    const auto value = text.find("calls=", colon);
    calls[text.substr(at + 8, colon - at - 8)] = std::atoll(text.c_str() + value + 6);
    at = colon;
  }
  return calls;
}

// The INFO commandstats delta over a benchmark's timed loop, per iteration, as counters. Every
// benchmark here reports them (the CSV reporter wants the same counters in every row).
class CommandCounter {
 public:
  CommandCounter() : stats_(connect_raw()), before_(command_calls(stats_.get())) {}
  void report(benchmark::State& state) {
    const auto after = command_calls(stats_.get());
    long long total = 0;
    for (const auto& [name, calls] : after) {
      if (name == "info") continue;  // our own two INFO calls
      const auto it = before_.find(name);
      total += calls - (it == before_.end() ? 0 : it->second);
    }
    const auto evalsha =
        after.count("evalsha") ? after.at("evalsha") - (before_.count("evalsha") ? before_.at("evalsha") : 0) : 0;
    const auto pairs = static_cast<double>(std::max<std::int64_t>(1, state.iterations()));
    state.counters["commands_per_pair"] = static_cast<double>(total) / pairs;
    state.counters["evalsha_per_pair"] = static_cast<double>(evalsha) / pairs;
  }

 private:
  Context stats_;
  std::map<std::string, long long> before_;
};

void BM_RedisPingPair(benchmark::State& state) {
  auto context = connect_raw();
  command(context.get(), "PING");
  CommandCounter counter;  // after the loop ends, nothing is timed
  for (auto _ : state) {
    Reply first(static_cast<redisReply*>(redisCommand(context.get(), "PING")));
    Reply second(static_cast<redisReply*>(redisCommand(context.get(), "PING")));
    if (!first || !second) {
      state.SkipWithError("PING failed");
      break;
    }
  }
  counter.report(state);
}

// A reference between the two: two EVALSHA round trips of a script that does nothing, the
// fixed cost of running a script (what the scripts' bodies add comes on top of it).
void BM_RedisEmptyScriptPair(benchmark::State& state) {
  auto context = connect_raw();
  const auto loaded = command(context.get(), "SCRIPT LOAD %s", "return 1");
  const std::string sha(loaded->str, loaded->len);
  CommandCounter counter;
  for (auto _ : state) {
    Reply first(static_cast<redisReply*>(redisCommand(context.get(), "EVALSHA %s 0", sha.c_str())));
    Reply second(static_cast<redisReply*>(redisCommand(context.get(), "EVALSHA %s 0", sha.c_str())));
    if (!first || !second || first->type == REDIS_REPLY_ERROR) {
      state.SkipWithError("EVALSHA failed");
      break;
    }
  }
  counter.report(state);
}

void BM_RedisMutex(benchmark::State& state) {
  auto client = turnstile::Client::connect(g_url);
  auto mutex = client.mutex("bench/redis-uncontended");
  mutex.lock();  // keep the first use out of the timing, as the file:// benchmark does
  mutex.unlock();
  CommandCounter counter;
  for (auto _ : state) {
    mutex.lock();
    mutex.unlock();
  }
  counter.report(state);
}

// N lock+unlock pairs under MONITOR: which commands the client sends per pair.
int count_commands(long pairs) {
  auto monitor = connect_raw();
  Reply ok(static_cast<redisReply*>(redisCommand(monitor.get(), "MONITOR")));
  if (!ok) throw std::runtime_error("MONITOR failed");
  const std::string marker = "turnstile-bench-monitor-end-" + std::to_string(getpid());
  std::map<std::string, long> sent;  // by the client, by command name
  long from_scripts = 0;
  bool started = false;  // after the start marker
  std::thread reader([&] {
    for (;;) {
      void* raw = nullptr;
      if (redisGetReply(monitor.get(), &raw) != REDIS_OK || !raw) return;
      Reply line(static_cast<redisReply*>(raw));
      if (line->type != REDIS_REPLY_STATUS) continue;
      // 1700000000.123456 [0 127.0.0.1:40000] "EVALSHA" "..." ... ; [0 lua] inside a script
      const std::string text(line->str, line->len);
      if (text.find(marker + "-start") != std::string::npos) {
        started = true;
        continue;
      }
      if (text.find(marker) != std::string::npos) return;
      const auto open = text.find('[');
      const auto bracket = text.find(']');
      if (!started || open == std::string::npos || bracket == std::string::npos) continue;
      if (text.substr(open, bracket - open).ends_with(" lua")) {
        ++from_scripts;
        continue;
      }
      const auto quote = text.find('"', bracket);
      const auto name = text.substr(quote + 1, text.find('"', quote + 1) - quote - 1);
      std::string lower;
      for (char c : name) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      ++sent[lower];
    }
  });
  {
    auto client = turnstile::Client::connect(g_url);
    auto mutex = client.mutex("bench/redis-uncontended");
    // Connecting loads the scripts and reads INFO: leave that out, start counting from here.
    mutex.lock();
    mutex.unlock();
    auto other = connect_raw();
    command(other.get(), "ECHO %s-start", marker.c_str());
    for (long i = 0; i < pairs; ++i) {
      mutex.lock();
      mutex.unlock();
    }
    command(other.get(), "ECHO %s", marker.c_str());
  }
  reader.join();
  long total = 0;
  for (const auto& [name, calls] : sent) total += calls;
  std::printf("{\"pairs\":%ld,\"sent_per_pair\":%.3f,\"from_scripts_per_pair\":%.3f", pairs,
              static_cast<double>(total) / static_cast<double>(pairs),
              static_cast<double>(from_scripts) / static_cast<double>(pairs));
  for (const auto& [name, calls] : sent) {
    std::printf(",\"sent_%s_per_pair\":%.3f", name.c_str(), static_cast<double>(calls) / static_cast<double>(pairs));
  }
  std::printf("}\n");
  return 0;
}

}  // namespace

// Real time throughout: the client has background threads, and the comparison is wall time.
BENCHMARK(BM_RedisPingPair)->UseRealTime();
BENCHMARK(BM_RedisEmptyScriptPair)->UseRealTime();
BENCHMARK(BM_RedisMutex)->UseRealTime();

int main(int argc, char** argv) {
  long count = 0;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    if (!std::strncmp(argv[i], "--url=", 6)) g_url = argv[i] + 6;
    else if (!std::strcmp(argv[i], "--count-commands") && i + 1 < argc) count = std::atol(argv[++i]);
    else rest.push_back(argv[i]);
  }
  if (g_url.empty() && std::getenv("TURNSTILE_BENCH_REDIS_URL")) g_url = std::getenv("TURNSTILE_BENCH_REDIS_URL");
  if (g_url.empty()) {
    std::fprintf(stderr, "usage: %s --url=redis://HOST:PORT [--count-commands N | google benchmark flags]\n", argv[0]);
    return 64;
  }
  try {
    if (count > 0) return count_commands(count);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  int rest_argc = static_cast<int>(rest.size());
  benchmark::Initialize(&rest_argc, rest.data());
  if (benchmark::ReportUnrecognizedArguments(rest_argc, rest.data())) return 64;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
