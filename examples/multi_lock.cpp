// SPDX-License-Identifier: Apache-2.0
// MultiLock: all or nothing. A transfer between two accounts holds both account locks and one
// of a limited number of transfer slots; if any of them cannot be had, none is kept.
//
//   ./example_multi_lock [file:///some/dir]
#include <turnstile/turnstile.hpp>

#include <cstdio>
#include <latch>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

std::map<int, long> balances{{1, 100}, {2, 100}};  // stands for a database

void transfer(turnstile::Client& client, int from, int to, long amount) {
  // Always name the accounts in the same order (lowest id first) in every process, so that two
  // opposite transfers cannot deadlock each other.
  auto first = client.mutex("accounts/" + std::to_string(std::min(from, to)));
  auto second = client.mutex("accounts/" + std::to_string(std::max(from, to)));
  auto slots = client.semaphore("transfers", 4).lockable();  // at most 4 transfers at once

  turnstile::MultiLock all(first, second, slots);
  std::lock_guard guard(all);  // takes them in order; on failure releases in reverse
  balances[from] -= amount;
  balances[to] += amount;
}  // ~lock_guard: released in reverse order

}  // namespace

int main(int argc, char** argv) try {
  auto client = argc > 1 ? turnstile::Client::connect(argv[1]) : turnstile::Client::connect();

  std::vector<std::jthread> tellers;
  for (int i = 0; i < 4; ++i) {
    tellers.emplace_back([&, i] {
      for (int k = 0; k < 25; ++k) i % 2 ? transfer(client, 1, 2, 3) : transfer(client, 2, 1, 2);
    });
  }
  tellers.clear();  // join
  std::printf("balances: account 1 = %ld, account 2 = %ld, total %ld\n", balances[1], balances[2],
              balances[1] + balances[2]);

  // try_lock_for gives up, keeping nothing, while one account is busy elsewhere.
  auto a = client.mutex("accounts/1"), b = client.mutex("accounts/2");
  std::latch busy_holds(1), done(1);
  std::jthread busy([&] {
    auto b_elsewhere = client.mutex("accounts/2");
    std::lock_guard hold(b_elsewhere);
    busy_holds.count_down();
    done.wait();
  });
  busy_holds.wait();
  turnstile::MultiLock both(a, b);
  const bool got = both.try_lock_for(std::chrono::milliseconds(20));
  std::printf("both accounts within 20 ms while 2 is busy: %s; account 1 kept: %s\n", got ? "yes (bug!)" : "no",
              a.owns_lock() ? "yes (bug!)" : "no");
  if (got) both.unlock();
  done.count_down();
  return balances[1] + balances[2] == 200 && !got ? 0 : 1;
} catch (const turnstile::Error& error) {  // a bad URL, a server that cannot be reached, ...
  std::fprintf(stderr, "%s\n", error.what());
  return error.code() == turnstile::ErrorCode::invalid_url ? 64 : 69;  // EX_USAGE, EX_UNAVAILABLE
}
