// SPDX-License-Identifier: Apache-2.0
#include "backends/redis/keys.hpp"

#include "backends/redis/cluster.hpp"
#include "core/text_escape.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail::redis {
namespace {

bool kept_in_a_tag(unsigned char c) { return c != '{' && c != '}' && c != '%'; }

}  // namespace

// A name's key and channel share one hash tag, so a Redis Cluster keeps them in one slot. The
// tag is the name with '{', '}' and '%' percent-encoded: any name, braces included, stays whole.
std::string queue_tag(const std::string& name) { return "turnstile:{" + percent_encode(name, kept_in_a_tag) + "}:"; }

// One hash per name. Pub/Sub ignores the selected database, so the channel names it: a
// release in db 0 must not even wake db 1's waiters of the same name.
QueueKeys queue_keys(const std::string& name, int db) {
  const auto tag = queue_tag(name);
  return {{tag + "q"}, tag + "w:" + std::to_string(db)};
}

// PermitCounter names that could reach turnstile's own keys: every queue key starts with
// "turnstile:" and every counter's waiter line contains ":turnstile:". Refused before anything
// is read or written, so no counter can alias a lock's state or another counter's line.
void check_counter_name(const std::string& name) {
  if (name.rfind("turnstile:", 0) == 0 || name.find(":turnstile:") != std::string::npos) {
    throw InvalidArgument("PermitCounter '" + name +
                          "': on redis:// a counter name may not start with 'turnstile:' or contain ':turnstile:' "
                          "(turnstile's own keys)");
  }
}

// Redisson's RSemaphore: the permit count is the plain key NAME, releases go to
// prefixName("redisson_sc", NAME), which adds braces only when NAME has no '{' at all.
// turnstile's waiter line must sit in NAME's cluster slot: reuse NAME's own hash tag, or make
// NAME the tag. On a cluster, a NAME with a '}' but no tag ("x}y", "a{}b") cannot be a tag,
// so a number that hashes to NAME's slot is (elsewhere such names keep the first form, as
// before, so clients of both versions share one line). The three forms differ in shape (and a
// NAME with ":turnstile:" is refused), so no two names share a line.
QueueKeys counter_keys(const std::string& name, bool cluster) {
  check_counter_name(name);
  const auto open = name.find('{');
  const auto close = open == std::string::npos ? std::string::npos : name.find('}', open + 1);
  const bool has_tag = close != std::string::npos && close > open + 1;
  const bool brace_cannot_tag = cluster && !has_tag && name.find('}') != std::string::npos;
  const std::string line = has_tag            ? name + ":turnstile:t"
                           : brace_cannot_tag ? "{" + tag_for_slot(key_slot(name)) + "}:turnstile:k:" + name
                                              : "{" + name + "}:turnstile:c";
  const std::string channel = open != std::string::npos ? "redisson_sc:" + name : "redisson_sc:{" + name + "}";
  return {{name, line}, channel};
}
}  // namespace turnstile::detail::redis
