// SPDX-License-Identifier: Apache-2.0
// A program of someone else's, built against an installed turnstile (find_package or pkg-config).
#include <turnstile/turnstile.hpp>

#include <cstdio>
#include <mutex>

int main(int argc, char** argv) {
  if (argc < 2) return 64;
  auto client = turnstile::Client::connect(argv[1]);
  auto mutex = client.mutex("consumer/job");
  std::lock_guard guard(mutex);
  std::printf("turnstile %s, token %llu\n", turnstile::version(),
              static_cast<unsigned long long>(mutex.fencing_token()));
  return 0;
}
