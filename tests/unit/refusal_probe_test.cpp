// SPDX-License-Identifier: Apache-2.0
// The refusal probe (core/refusal_probe.hpp): only a refusal by every address of every server
// is a definite answer; an accepting server, an unresolvable name or a malformed entry is not.
#include "core/refusal_probe.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "support/local_port.hpp"

namespace {

using turnstile::SteadyClock;
using turnstile::detail::every_server_refuses;
using turnstile::detail::split_server_list;

using turnstile_test::LocalPort;

SteadyClock::time_point soon() { return SteadyClock::now() + std::chrono::seconds(2); }

TEST(RefusalProbe, EveryServerRefusingIsARefusal) {
  LocalPort first(false), second(false);
  EXPECT_TRUE(every_server_refuses({first.address()}, soon()));
  EXPECT_TRUE(every_server_refuses({first.address(), second.address()}, soon()));
  EXPECT_TRUE(every_server_refuses({first.address("localhost")}, soon()));
}

TEST(RefusalProbe, OneAcceptingServerIsNoRefusal) {
  LocalPort refusing(false), accepting(true);
  EXPECT_FALSE(every_server_refuses({accepting.address()}, soon()));
  EXPECT_FALSE(every_server_refuses({refusing.address(), accepting.address()}, soon()));
  EXPECT_FALSE(every_server_refuses({accepting.address(), refusing.address()}, soon()));
}

TEST(RefusalProbe, WhatCannotBeAskedIsNoRefusal) {
  LocalPort refusing(false);
  EXPECT_FALSE(every_server_refuses({}, soon()));
  EXPECT_FALSE(every_server_refuses({refusing.address(), "no-such-host.invalid:2181"}, soon()));
  EXPECT_FALSE(every_server_refuses({refusing.address(), "127.0.0.1"}, soon()));
}

TEST(RefusalProbe, ServerListsSplitAtCommas) {
  EXPECT_EQ(split_server_list("a:1,b:2,[::1]:3"), (std::vector<std::string>{"a:1", "b:2", "[::1]:3"}));
  EXPECT_EQ(split_server_list("a:1"), (std::vector<std::string>{"a:1"}));
  EXPECT_TRUE(split_server_list("").empty());
}

}  // namespace
