#include "backends/consul/occupancy.hpp"

#include "backends/consul/consul_backend.hpp"

namespace turnstile::detail::consul {

void end_occupancy_if_last(ConsulBackend& backend, const std::string& name,
                           std::chrono::milliseconds timeout) noexcept {
  try {
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
