// Uncontended lock+unlock per second on the zk:// backend against its limit: the same three
// requests (create ephemeral-sequential, getChildren, delete) sent raw with the same C client.
// Curator's InterProcessMutex, the peer, is measured by ZookeeperCuratorBench.java on the same
// server in the same run.
//   turnstile_bench_zookeeper zk://127.0.0.1:PORT [SECONDS]
#include <zookeeper/zookeeper.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include <turnstile/turnstile.hpp>

namespace {
using Clock = std::chrono::steady_clock;

template <class Body>
double per_second(double seconds, Body body) {
  for (int i = 0; i < 200; ++i) body();  // warm up
  const auto start = Clock::now();
  long count = 0;
  while (std::chrono::duration<double>(Clock::now() - start).count() < seconds) {
    body();
    ++count;
  }
  return count / std::chrono::duration<double>(Clock::now() - start).count();
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s zk://host:port [seconds]\n", argv[0]);
    return 64;
  }
  const std::string url = argv[1];
  const double seconds = argc > 2 ? std::atof(argv[2]) : 5;
  auto client = turnstile::Client::connect(url);
  auto mutex = client.recursive_mutex("bench/zk-uncontended");
  const double turnstile_rate = per_second(seconds, [&] {
    mutex.lock();
    mutex.unlock();
  });

  zoo_set_debug_level(static_cast<ZooLogLevel>(0));
  zhandle_t* zh = zookeeper_init(url.substr(5).c_str(), nullptr, 30000, nullptr, nullptr, 0);
  while (zoo_state(zh) != ZOO_CONNECTED_STATE) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  zoo_create(zh, "/bench", "", 0, &ZOO_OPEN_ACL_UNSAFE, 0, nullptr, 0);
  zoo_create(zh, "/bench/zk-raw", "", 0, &ZOO_OPEN_ACL_UNSAFE, 0, nullptr, 0);
  const double raw_rate = per_second(seconds, [&] {
    char created[256];
    zoo_create(zh, "/bench/zk-raw/_c_00000000-0000-4000-8000-000000000000-lock-", "x", 1, &ZOO_OPEN_ACL_UNSAFE,
               ZOO_EPHEMERAL_SEQUENTIAL, created, sizeof created);
    String_vector children{};
    zoo_get_children(zh, "/bench/zk-raw", 0, &children);
    deallocate_String_vector(&children);
    zoo_delete(zh, created, -1);
  });
  zookeeper_close(zh);
  std::printf("turnstile RecursiveMutex lock+unlock/s: %.0f\n", turnstile_rate);
  std::printf("raw create+getChildren+delete/s:        %.0f\n", raw_rate);
  std::printf("turnstile / raw:                        %.3f\n", turnstile_rate / raw_rate);
  return 0;
}
