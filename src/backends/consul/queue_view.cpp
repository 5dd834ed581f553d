// SPDX-License-Identifier: Apache-2.0
#include "backends/consul/queue_view.hpp"

#include <algorithm>

namespace turnstile::detail::consul {

QueueView make_queue_view(const std::vector<KvEntry>& entries, const std::string& prefix, std::uint64_t index,
                          const QueueView* previous) {
  QueueView view;
  view.index = index;
  std::size_t before = 0;  // both are by CreateIndex: one walk finds each entry's earlier copy
  for (const auto& entry : children(entries, prefix)) {
    while (previous && before < previous->entries.size() &&
           previous->entries[before].create_index < entry.create_index) {
      ++before;
    }
    if (previous && before < previous->entries.size() && previous->entries[before].key == entry.key &&
        previous->entries[before].modify_index == entry.modify_index) {
      view.entries.push_back(previous->entries[before]);
    } else {
      const auto value = entry_value(entry.value);
      view.entries.push_back({entry.key, entry.session, entry.create_index, entry.modify_index, value.kind,
                              value.permits, value.limit, value.sessions, value.election});
    }
    if (index == 0) view.index = std::max(view.index, entry.modify_index);
  }
  return view;
}

}  // namespace turnstile::detail::consul
