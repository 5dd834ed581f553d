// SPDX-License-Identifier: Apache-2.0
// The ZooKeeper node paths and node data as they are stored (src/backends/zookeeper/nodes.cpp,
// compiled in): a change of spelling would move every name's nodes away from its Curator peers
// and from the nodes of clients already running, so each escape is pinned here byte for byte.
#include <gtest/gtest.h>

#include <unistd.h>

#include <string>

#include "backends/zookeeper/nodes.hpp"
#include "core/host_name.hpp"

namespace {

using turnstile::detail::zookeeper::encode_name;

TEST(ZookeeperLayout, NamesCuratorUsersWriteAreTheirPaths) {
  EXPECT_EQ(encode_name("a"), "a");
  EXPECT_EQ(encode_name("a/b/c"), "a/b/c");
  EXPECT_EQ(encode_name("with space{}[]()'\"`*?<>|\\:;&$!#~=+,@^"), "with space{}[]()'\"`*?<>|\\:;&$!#~=+,@^");
  EXPECT_EQ(encode_name("caf\xC3\xA9/\xE6\x97\xA5\xE6\x9C\xAC"), "caf\xC3\xA9/\xE6\x97\xA5\xE6\x9C\xAC");
  EXPECT_EQ(encode_name("a/locksmith"), "a/locksmith");
  EXPECT_EQ(encode_name("locks/a"), "locks/a");  // the first segment is nobody's child
}

TEST(ZookeeperLayout, PercentAndRefusedCodePointsAreUpperCaseEscapes) {
  EXPECT_EQ(encode_name("100%"), "100%25");
  EXPECT_EQ(encode_name("%41"), "%2541");
  EXPECT_EQ(encode_name("del\x7F"), "del%7F");
  EXPECT_EQ(encode_name("c1\xC2\x85"), "c1%C2%85");                    // U+0085
  EXPECT_EQ(encode_name("pua\xEE\x80\x80"), "pua%EE%80%80");           // U+E000
  EXPECT_EQ(encode_name("\xEF\xBF\xBF"), "%EF%BF%BF");                 // U+FFFF
  EXPECT_EQ(encode_name("lock\xF0\x9F\x94\x92"), "lock%F0%9F%94%92");  // U+1F512
  EXPECT_EQ(encode_name("\xC2\xA0"), "\xC2\xA0");                      // U+00A0 is taken
}

TEST(ZookeeperLayout, ASegmentShapedLikeANamesNodeHasItsFirstByteEscaped) {
  EXPECT_EQ(encode_name("a/locks"), "a/%6Cocks");
  EXPECT_EQ(encode_name("a/leases/x"), "a/%6Ceases/x");
  EXPECT_EQ(encode_name("a/permits"), "a/%70ermits");
  EXPECT_EQ(encode_name("a/permit-waiters"), "a/%70ermit-waiters");
  EXPECT_EQ(encode_name("a/lock-0000000007"), "a/%6Cock-0000000007");
  EXPECT_EQ(encode_name("a/__READ__0000000001"), "a/%5F_READ__0000000001");
  EXPECT_EQ(encode_name("a/_c_0a1b2c3d-0000-4e5f-8a9b-0c1d2e3f4a5b-lease-0000000001"),
            "a/%5Fc_0a1b2c3d-0000-4e5f-8a9b-0c1d2e3f4a5b-lease-0000000001");
}

TEST(ZookeeperLayout, NodeDataNamesThePidAndTheHost) {
  const auto host = turnstile::detail::host_name();
  const auto pid = std::to_string(getpid());
  const auto prefix = "turnstile pid=" + pid + " host=" + host;
  EXPECT_EQ(turnstile::detail::zookeeper::node_data("exclusive", ""), prefix + " kind=exclusive");
  EXPECT_EQ(turnstile::detail::zookeeper::node_data("lease", "job 7", 3), prefix + " kind=lease permits=3 label=job 7");
}

}  // namespace
