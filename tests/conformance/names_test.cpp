// SPDX-License-Identifier: Apache-2.0
// Every name the core accepts works on every backend, whatever a backend's own key rules are
// (issue 22, item 15): names with dots where paths have them ("x..", "a/b..", "..x"), bytes a
// key format escapes ('%', '+', ',', spaces, UTF-8), and names whose escaped forms could meet.
#include "conformance/support.hpp"

namespace conformance {
namespace {

// Leaves put after the test's prefix ("<prefix>/<leaf>", `prefix` ending in '/'), and names that
// must start with dots, made from the prefix so tests never share them ("..<prefix>/x").
std::vector<std::string> odd_names(const std::string& prefix) {
  std::vector<std::string> names;
  for (const char* leaf : {"x..",
                           "a/b..",
                           "a/..b",
                           "a../b",
                           "x...",
                           "x.",
                           "a./b",
                           "...",
                           "x..json",
                           "x.json",
                           "a..b",
                           "a/..x",
                           "a/...",
                           "a/.lock",
                           ".lock",
                           "100%",
                           "%2e%2e",
                           "a+b",
                           "a,b",
                           "a,2E",
                           "with space",
                           "a\\b",
                           "\xc3\xbc\xe6\x97\xa5\xf0\x9f\x94\x92"}) {
    names.push_back(prefix + leaf);
  }
  names.push_back(".." + prefix + "x");
  names.push_back("..." + prefix + "x");
  names.push_back("." + prefix + "x");
  return names;
}

}  // namespace

// Each name takes and gives back every primitive, and a second client is kept out while the
// first holds it: the name is one place on the server, whatever path the backend took to it.
TEST_P(Conformance, OddNamesWorkWithEveryPrimitive) {
  auto other = connect();
  for (const auto& odd : odd_names(name(""))) {
    SCOPED_TRACE("name \"" + odd + "\"");
    auto mutex = client().mutex(odd);
    ASSERT_TRUE(mutex.try_lock());
    EXPECT_EQ(holder_count(odd), 1u);
    EXPECT_FALSE(other.mutex(odd).try_lock());
    mutex.unlock();
    auto lease = client().semaphore(odd, 1).try_acquire();
    ASSERT_TRUE(lease.has_value());
    EXPECT_FALSE(other.semaphore(odd, 1).try_acquire().has_value());
    lease.reset();
    auto shared = client().shared_mutex(odd);
    ASSERT_TRUE(shared.try_lock_shared());
    EXPECT_FALSE(other.shared_mutex(odd).try_lock());
    shared.unlock_shared();
    auto counter = client().permit_counter(odd);
    EXPECT_TRUE(counter.try_set_permits(2));
    EXPECT_TRUE(other.permit_counter(odd).try_acquire(2));
    EXPECT_EQ(counter.available_permits(), 0);
    counter.release(2);
    EXPECT_EQ(counter.available_permits(), 2);
  }
}

// Names an escaping scheme might map to one key are held at once by two clients, each alone.
TEST_P(Conformance, OddNamesNeverShareAPlace) {
  auto other = connect();
  const auto names = odd_names(name(""));
  std::vector<turnstile::Mutex> held;
  for (const auto& odd : names) {
    SCOPED_TRACE("name \"" + odd + "\"");
    held.push_back(client().mutex(odd));
    ASSERT_TRUE(held.back().try_lock());
    EXPECT_TRUE(other.permit_counter(odd).try_set_permits(1));
  }
  for (const auto& odd : names) {
    SCOPED_TRACE("name \"" + odd + "\"");
    EXPECT_EQ(holder_count(odd), 1u);
    EXPECT_EQ(other.permit_counter(odd).available_permits(), 1);
  }
  for (auto& mutex : held) mutex.unlock();
}

// A Mutex whose name is another name's Semaphore key (Semaphore "col" keeps "col/.lock" on
// Consul, as api.Semaphore does) is its own place: both are held at once by different clients,
// and each keeps out a second contender of its own kind.
TEST_P(Conformance, NamesOfOnePrimitiveNeverReachAnothersKeys) {
  auto other = connect();
  const auto prefix = name("");
  auto lease = client().semaphore(prefix + "col", 1).try_acquire();
  ASSERT_TRUE(lease.has_value());
  for (const auto* leaf : {"col/.lock", "col/.lock/.lock"}) {
    SCOPED_TRACE(leaf);
    auto mutex = other.mutex(prefix + leaf);
    ASSERT_TRUE(mutex.try_lock());
    EXPECT_FALSE(client().mutex(prefix + leaf).try_lock());
    EXPECT_FALSE(connect().semaphore(prefix + "col", 1).try_acquire().has_value());
    mutex.unlock();
  }
  lease.reset();
  auto again = other.semaphore(prefix + "col", 1).try_acquire();
  EXPECT_TRUE(again.has_value());
}

}  // namespace conformance
