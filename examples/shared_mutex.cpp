// SPDX-License-Identifier: Apache-2.0
// SharedMutex: many readers or one writer, with a downgrade from writer to reader.
//
//   ./example_shared_mutex [file:///some/dir]
//
// Readers use std::shared_lock; the writer uses std::unique_lock, then downgrades: it takes
// the read lock before dropping the write lock, so no other writer can slip in between the
// update and the publication that reads it.
#include <turnstile/turnstile.hpp>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

int main(int argc, char** argv) try {
  auto client = argc > 1 ? turnstile::Client::connect(argv[1]) : turnstile::Client::connect();

  std::string catalog = "v1";  // stands for shared state on disk or in a database
  std::atomic<int> readers_inside{0};

  // Several readers at once.
  std::vector<std::jthread> readers;
  for (int i = 0; i < 3; ++i) {
    readers.emplace_back([&, i] {
      auto rw = client.shared_mutex("catalog");
      std::shared_lock reader(rw);  // lock_shared(): admitted alongside other readers
      const int inside = ++readers_inside;
      std::printf("reader %d reads %s (%d reader(s) inside)\n", i, catalog.c_str(), inside);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      --readers_inside;
    });
  }
  readers.clear();  // join

  // The writer: update, then downgrade to publish what it wrote.
  auto rw = client.shared_mutex("catalog");
  {
    std::unique_lock writer(rw);  // exclusive: waits for the readers to leave
    catalog = "v2";
    rw.lock_shared();  // downgrade, step 1: take the read lock while still writing...
    writer.unlock();   // ...step 2: drop the write lock; the queue entry becomes a reader
    std::printf("publishing %s under the read lock only (writer: %s, reader: %s)\n", catalog.c_str(),
                rw.owns_lock() ? "yes" : "no", rw.owns_shared() ? "yes" : "no");

    // Other readers get in now; a writer would still wait.
    std::jthread([&] {
      auto other = client.shared_mutex("catalog");
      const bool read = other.try_lock_shared();
      if (read) other.unlock_shared();
      const bool write = other.try_lock();
      if (write) other.unlock();
      std::printf("another thread: read %s, write %s\n", read ? "admitted" : "refused",
                  write ? "admitted (bug!)" : "refused");
    });
    rw.unlock_shared();
  }

  // A reader asking for the write lock would deadlock against itself: it throws instead.
  std::shared_lock reader(rw);
  try {
    rw.lock();
  } catch (const turnstile::WouldDeadlock& e) {
    std::printf("upgrade refused: %s\n", e.what());
  }
  return 0;
} catch (const turnstile::Error& error) {  // a bad URL, a server that cannot be reached, ...
  std::fprintf(stderr, "%s\n", error.what());
  return error.code() == turnstile::ErrorCode::invalid_url ? 64 : 69;  // EX_USAGE, EX_UNAVAILABLE
}
