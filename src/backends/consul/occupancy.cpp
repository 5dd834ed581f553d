// SPDX-License-Identifier: Apache-2.0
#include "backends/consul/occupancy.hpp"

#include "backends/consul/consul_backend.hpp"

namespace turnstile::detail::consul {

namespace {

// Whether the last one to join (the occupancy key's value: its entry's id) is still in line:
// then the queue is not empty, told by one key instead of a read of the whole queue (a long
// queue's every release asks).
bool last_joiner_in_line(ConsulBackend& backend, const std::string& name, std::chrono::milliseconds timeout) {
  const auto occupancy = backend.read(occupancy_key(name), false, timeout);
  if (occupancy.empty() || occupancy.front().value.empty()) return false;
  const auto entry = backend.read(queue_prefix(name) + occupancy.front().value, false, timeout);
  return !entry.empty();
}

}  // namespace

void end_occupancy_if_last(ConsulBackend& backend, const std::string& name,
                           std::chrono::milliseconds timeout) noexcept {
  try {
    if (last_joiner_in_line(backend, name, timeout)) return;
    const auto prefix = queue_prefix(name);
    const auto key = occupancy_key(name);
    const auto context = "ending the occupancy of '" + name + "'";
    nlohmann::json look = nlohmann::json::array();
    look.push_back(kv_op("get-tree", prefix));
    look.push_back(kv_op("get-or-empty", key));
    const auto seen = backend.txn(look, timeout, context);
    if (!seen) return;
    std::uint64_t index = 0;
    for (const auto& entry : *seen) {
      if (entry.key == key && entry.create_index != 0) index = entry.modify_index;
    }
    // Only this name's own entries count (a nested name's queue lies under the prefix too).
    if (index == 0 || !children(*seen, prefix).empty()) return;
    auto end = kv_op("delete-cas", key);
    end["KV"]["Index"] = index;
    Refused refused;  // refused: someone joined since, and the occupancy is theirs
    backend.txn(nlohmann::json::array({end}), timeout, context, &refused);
  } catch (...) {
    // No server, no right to it, or no memory: the key stays (see the header).
  }
}

}  // namespace turnstile::detail::consul
