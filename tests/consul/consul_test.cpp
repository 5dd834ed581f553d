// What only the Consul backend promises, against the Consul test stand-in (tests/servers/
// consul_server.py, built from Consul's documentation and sources; not Consul).
#include <gtest/gtest.h>

#include "support/server_tests.hpp"

namespace {
TEST(Consul, Placeholder) {}
}  // namespace
