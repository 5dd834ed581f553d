// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <deque>
#include <map>

#include "backends/zookeeper/counts.hpp"
#include "backends/zookeeper/zookeeper_backend.hpp"
#include "core/text_escape.hpp"

namespace turnstile::detail::zookeeper {

void ZookeeperBackend::inspect_lock(Session& session, const std::string& path, const std::vector<std::string>& children,
                                    Inspection& result, Deadline deadline) {
  // Who holds is the core's predicate's answer for each entry, downgraded writers as readers.
  std::vector<QueueEntryView> queue;
  std::vector<EntryInfo> infos;
  for (const auto& entry : sorted_entries(children)) {
    Stat stat{};
    const auto data = read(session, path + "/" + entry.node, false, deadline, &stat);
    if (!data) continue;  // left meanwhile
    // A candidate's data is its value alone (LeaderLatch's layout): no pid or host to show.
    const auto node = entry.latch ? NodeInfo{} : parse_node_data(*data);
    const auto kind = entry.kind == EntryKind::shared || node.downgraded ? EntryKind::shared : EntryKind::exclusive;
    queue.push_back({kind, 1});
    infos.push_back(entry_info(node, stat, to_string(kind)));
    infos.back().permits = 1;
    if (entry.latch) infos.back().value = *data;
  }
  for (std::size_t i = 0; i < infos.size(); ++i) {
    infos[i].holding = evaluate_queue(queue, i, 0).admitted();
    (infos[i].holding ? result.holders : result.waiters).push_back(std::move(infos[i]));
  }
}

void ZookeeperBackend::inspect_semaphore(Session& session, const std::string& path, Inspection& result,
                                         Deadline deadline) {
  const auto holders = sorted_entries(list(session, path + "/leases", false, deadline));
  const auto line = sorted_entries(list(session, path + "/locks", false, deadline));
  if (holders.empty() && line.empty()) return;
  result.mode = "semaphore";
  if (const auto data = read(session, path, false, deadline)) result.limit = recorded_limit(*data).value_or(0);
  // One holder per protection id: a contender's leases share it.
  std::map<std::string, EntryInfo> by_uuid;
  std::vector<std::string> order;
  for (const auto& entry : holders) {
    const auto key = entry.uuid.empty() ? entry.node : entry.uuid;
    auto it = by_uuid.find(key);
    if (it == by_uuid.end()) {
      Stat stat{};
      const auto data = read(session, path + "/leases/" + entry.node, false, deadline, &stat);
      if (!data) continue;  // released meanwhile (its token, the czxid, is read with it)
      order.push_back(key);
      it = by_uuid.emplace(key, entry_info(parse_node_data(*data), stat, "lease")).first;
      it->second.permits = 0;  // counted below, one per lease node
      it->second.holding = true;
    }
    ++it->second.permits;
  }
  for (const auto& key : order) result.holders.push_back(by_uuid[key]);
  for (const auto& entry : line) {
    if (by_uuid.count(entry.uuid)) continue;  // admitted, leaving the line right now
    Stat stat{};
    const auto data = read(session, path + "/locks/" + entry.node, false, deadline, &stat);
    if (!data) continue;
    result.waiters.push_back(entry_info(parse_node_data(*data), stat, "lease"));
  }
}

Inspection ZookeeperBackend::inspect(const std::string& name, Deadline until) {
  auto deadline = call_deadline();
  if (until) deadline = std::min(*deadline, *until);
  auto session = session_for(deadline);
  // A deadline that is near or past still gets one answer from the server (as a queue step's
  // calls do, call_bound): a leader read right at an observer's deadline is an answer, not trouble.
  if (until) deadline = std::max(*deadline, std::min(*call_deadline(), SteadyClock::now() + session->short_wait()));
  const auto path = path_of(name);
  return outside_queue("inspect", [&] {
    Inspection result;
    result.name = name;
    const auto children = list(*session, path, false, deadline);
    if (const auto entries = sorted_entries(children); !entries.empty()) {
      result.mode = entries.front().latch ? "election" : "lock";
      inspect_lock(*session, path, children, result, deadline);
    } else if (std::find(children.begin(), children.end(), "locks") != children.end() ||
               std::find(children.begin(), children.end(), "leases") != children.end()) {
      inspect_semaphore(*session, path, result, deadline);
    }
    if (const auto value = read(*session, path + "/permits", false, deadline)) {
      if (const auto count = parse_count(*value)) result.permits = saturated(count->value);
    }
    for (const auto& entry : sorted_entries(list(*session, path + "/permit-waiters", false, deadline))) {
      Stat stat{};
      const auto data = read(*session, path + "/permit-waiters/" + entry.node, false, deadline, &stat);
      if (!data) continue;
      result.waiters.push_back(entry_info(parse_node_data(*data), stat, "permits"));
    }
    return result;
  });
}

namespace {

// A name's node has children of its own besides the nodes of longer names: its entries and
// fixed nodes (nodes.hpp). encode_name escapes a longer name's segment that looks like one.
bool is_names_own_child(const std::string& child) {
  return parse_entry(child).has_value() || child == "locks" || child == "leases" || child == "permits" ||
         child == "permit-waiters";
}

}  // namespace

// The children of the root (the URL's chroot), then theirs, breadth first: a name's node is the
// path of its %-escaped segments (nodes.hpp). Only nodes whose names start with the prefix, or
// lead to it, are listed below; every node of a name with the prefix is a candidate.
QueueNames ZookeeperBackend::queue_names(const std::string& prefix, std::size_t max_names, Deadline until) {
  const Deadline deadline = until ? until : call_deadline();
  auto session = session_for(deadline);
  const auto& root = connection_.settings().root;
  const std::string base = root.empty() ? "" : "/" + encode_name(root.substr(root.front() == '/' ? 1 : 0));
  return outside_queue("list names", [&] {
    QueueNames result;
    std::deque<std::pair<std::string, std::string>> to_visit{{base, ""}};  // node path, name
    while (!to_visit.empty()) {
      const auto [path, name] = std::move(to_visit.front());
      to_visit.pop_front();
      for (const auto& child : list(*session, path.empty() ? "/" : path, false, deadline)) {
        if (!name.empty() && is_names_own_child(child)) continue;
        const auto segment = percent_decode(child);
        if (!segment) continue;  // a node no name maps to
        const auto full = name.empty() ? *segment : name + "/" + *segment;
        const bool listed = full.starts_with(prefix);
        if (listed && !result.add(full, max_names)) return result;
        if (listed || prefix.starts_with(full + "/")) to_visit.emplace_back(path + "/" + child, full);
      }
    }
    return result;
  });
}

}  // namespace turnstile::detail::zookeeper
