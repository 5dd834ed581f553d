// SPDX-License-Identifier: Apache-2.0
// RecursiveMutex: reentrant per thread, like std::recursive_mutex across processes.
//
//   ./example_recursive_mutex [file:///some/dir]
//
// A function that takes the lock may call another that takes it again; the backend hold is
// released only when the outermost guard goes away.
#include <turnstile/turnstile.hpp>

#include <cstdio>
#include <mutex>
#include <thread>

namespace {

// Both functions lock the same account, so deposit() can be called on its own or from
// transfer_in() without deadlocking.
void deposit(turnstile::RecursiveMutex& account, int& balance, int amount) {
  std::lock_guard guard(account);  // hold count +1 (a new backend hold only if the first)
  balance += amount;
}

void transfer_in(turnstile::RecursiveMutex& account, int& balance, int amount, int fee) {
  std::lock_guard guard(account);     // outer hold
  deposit(account, balance, amount);  // inner hold by the same thread: just a count
  deposit(account, balance, -fee);
  std::printf("still held by us after the inner guards: %s, token %llu\n", account.owns_lock() ? "yes" : "no",
              static_cast<unsigned long long>(account.fencing_token()));
}  // count drops to zero: released

}  // namespace

int main(int argc, char** argv) try {
  auto client = argc > 1 ? turnstile::Client::connect(argv[1]) : turnstile::Client::connect();
  auto account = client.recursive_mutex("accounts/42");

  int balance = 100;
  transfer_in(account, balance, 50, 1);
  std::printf("after transfer_in: balance %d, still held: %s\n", balance, account.owns_lock() ? "yes" : "no");

  // Another thread (or process) waits while we hold it, even nested.
  {
    std::lock_guard outer(account);
    std::lock_guard inner(account);
    std::thread other([&] {
      auto same = client.recursive_mutex("accounts/42");
      std::printf("other thread try_lock while we hold it: %s\n",
                  same.try_lock() ? "got it (bug!)" : "busy, as expected");
    });
    other.join();
  }
  return 0;
} catch (const turnstile::Error& error) {  // a bad URL, a server that cannot be reached, ...
  std::fprintf(stderr, "%s\n", error.what());
  return error.code() == turnstile::ErrorCode::invalid_url ? 64 : 69;  // EX_USAGE, EX_UNAVAILABLE
}
