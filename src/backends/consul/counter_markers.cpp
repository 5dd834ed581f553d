// SPDX-License-Identifier: Apache-2.0
// Removing the request markers of settled PermitCounter changes (counter_markers.hpp).
#include "backends/consul/counter_markers.hpp"

#include <map>

#include "backends/consul/consul_backend.hpp"

namespace turnstile::detail::consul {

void SettledMarkers::add(ConsulBackend& backend, SettledMarker settled) {
  std::vector<SettledMarker> batch;
  {
    std::lock_guard lock(mutex_);
    pending_.push_back(std::move(settled));
    if (++added_since_sweep_ < kMarkerSweepBatch) return;
    added_since_sweep_ = 0;
    batch.swap(pending_);
  }
  backend.removals().add("settled counter markers", [&backend, this, batch = std::move(batch)]() mutable {
    nlohmann::json deletes = nlohmann::json::array();
    std::vector<SettledMarker> kept;
    std::map<std::string, std::uint64_t> counter_indexes;  // one read per counter
    for (const auto& item : batch) {
      if (item.marker.session->lease->lost()) continue;  // gone with its session
      if (item.voided) {
        auto index = counter_indexes.find(item.counter);
        if (index == counter_indexes.end()) {
          const auto seen = backend.read_counter(item.counter, kConsulTimes.one_shot.floor);
          index = counter_indexes.emplace(item.counter, seen.index).first;
        }
        // Still as its CAS named it (or still absent): a copy could pass the CAS, M must stay.
        if (index->second == item.seen_index) {
          kept.push_back(item);  // a copy: a failed round is tried again whole
          continue;
        }
      }
      deletes.push_back(kv_op("delete", item.marker.key));
    }
    if (!deletes.empty()) backend.txn(deletes, kConsulTimes.one_shot.floor, "removing settled counter markers");
    std::lock_guard lock(mutex_);
    for (auto& item : kept) pending_.push_back(std::move(item));
    return Removal::done;
  });
}

}  // namespace turnstile::detail::consul
