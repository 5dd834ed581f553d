// SPDX-License-Identifier: Apache-2.0
// A refused connection is a definite answer. The ZooKeeper C client and gRPC both keep
// reconnecting to a port that refuses (ECONNREFUSED) until their caller's connect timeout, so a
// mistyped port or a stopped server cost the whole timeout (10 s) before anyone said why.
// The backends ask this probe, when their client has not connected at once, whether every
// listed server refuses: then they fail at once with "connection refused".
#pragma once

#include <string>
#include <vector>

#include "turnstile/deadline.hpp"

namespace turnstile::detail {

// Whether every address of every server ("host:port" or "[IPv6]:port") refuses a TCP
// connection now. Anything that might still answer is not a refusal: an address that accepts
// (even if it then says nothing), one that does not answer by `until` (a dropped SYN, a paused
// host), a name that does not resolve by then, any other error. Returns as soon as one address
// accepts, and by `until` in any case (name resolution included); the connections it makes are
// closed at once, before a byte is sent.
bool every_server_refuses(const std::vector<std::string>& servers, SteadyClock::time_point until);

// "host:port,host:port" (the ZooKeeper C client's list) as one entry per server.
std::vector<std::string> split_server_list(const std::string& list);

}  // namespace turnstile::detail
