// SPDX-License-Identifier: Apache-2.0
// A name's pin on the directory is kept while its state file is open in a client (not taken
// and dropped per hold): what that must never cost. A client that merely used a name keeps
// nobody out of it for long after its file was removed or moved away by hand, and never takes a
// hold in the file it kept once that file is no longer at its path.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>

#include <turnstile/turnstile.hpp>

#include "file_backend/scratch_root.hpp"

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using turnstile::Client;

class FileKeptPin : public file_backend_test::ScratchRoot {
 protected:
  // A try that a pin on a missing file refuses (StateFileInUse) counts as not admitted.
  static bool try_lock(turnstile::Mutex& mutex) {
    try {
      return mutex.try_lock();
    } catch (const turnstile::BackendUnavailable&) {
      return false;
    }
  }

  // `user` held the name and keeps its file open (and its name pinned); the file is then taken
  // away by hand. Another client gets in once `user`'s watcher let the pin go (within 500 ms),
  // and `user` is then kept out by that holder: it never holds in the file it kept.
  void taken_away_by_hand(const std::string& name, const std::function<void()>& take_away) {
    auto user_client = Client::connect(url_);
    auto user = user_client.mutex(name);
    user.lock();
    user.unlock();
    take_away();
    auto other_client = Client::connect(url_);
    auto other = other_client.mutex(name);
    ASSERT_TRUE(eventually([&] { return try_lock(other); }, 5s)) << "a client that only used the name keeps it";
    EXPECT_FALSE(try_lock(user)) << "admitted in its kept file beside the holder of the one at the path";
    other.unlock();
    EXPECT_TRUE(try_lock(user));
    user.unlock();
  }
};

// Regression guards of the kept pin (a performance change: the old code, which pinned per
// hold, passes them too). Without the watcher's look at idle kept pins, the other client never
// gets in; with a kept file trusted once its pin was let go, the user holds beside it.
TEST_F(FileKeptPin, AFileRemovedByHandFreesTheNameOfAClientThatOnlyUsedIt) {
  taken_away_by_hand("removed", [&] { ASSERT_EQ(unlink(state_of("removed").c_str()), 0); });
}

TEST_F(FileKeptPin, AFileMovedAwayByHandIsNeverHeldAgainByTheClientThatKeptIt) {
  taken_away_by_hand("moved", [&] { ASSERT_EQ(rename(state_of("moved").c_str(), (scratch_ + "/aside").c_str()), 0); });
}

// A client that used a name keeps its file (and pin) while it keeps the name open; the file is
// removed as unused once the last client using the name closes it.
TEST_F(FileKeptPin, AKeptPinKeepsTheFileOnlyUntilItsClientClosesTheName) {
  {
    auto client = Client::connect(url_);
    auto mutex = client.mutex("closed");
    mutex.lock();
    mutex.unlock();
    {
      auto other_client = Client::connect(url_);
      auto other = other_client.mutex("closed");
      ASSERT_TRUE(other.try_lock());
      other.unlock();
    }
    EXPECT_TRUE(fs::exists(state_of("closed"))) << "removed while a client keeps it open";
    ASSERT_TRUE(mutex.try_lock());
    mutex.unlock();
  }
  EXPECT_FALSE(fs::exists(state_of("closed"))) << "left behind by the last client using it";
}

}  // namespace
