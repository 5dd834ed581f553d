// SPDX-License-Identifier: Apache-2.0
#include "backends/zookeeper/zookeeper_backend.hpp"

#include <algorithm>
#include <thread>
#include <utility>

#include "backends/zookeeper/places.hpp"

namespace turnstile::detail::zookeeper {

void ZookeeperBackend::ensure_path(Session& session, const std::string& path, const CallBudget& bound) {
  // Top down: each level exists or is created; a container left empty is reaped by the server,
  // also between our creates of two levels (the lower one then finds no parent: from the top
  // again, a few times at most).
  for (int pass = 1;; ++pass) {
    const int rc = create_levels(session, path, bound);
    if (rc == ZOK) return;
    if (rc != ZNONODE || pass == kPathPasses) give_up(bound, "create of '" + path + "'", rc);
  }
}

int ZookeeperBackend::create_levels(Session& session, const std::string& path, const CallBudget& bound) {
  for (std::size_t slash = path.find('/', 1);; slash = path.find('/', slash + 1)) {
    const auto prefix = slash == std::string::npos ? path : path.substr(0, slash);
    for (;;) {
      const int flags = containers_supported_ ? ZOO_CONTAINER : ZOO_PERSISTENT;
      Session::Creation creation{.path = prefix, .flags = flags};
      const int rc = session.create(creation, bound);
      if (rc == ZOK || rc == ZNODEEXISTS) break;
      if (rc == ZUNIMPLEMENTED && containers_supported_) {
        containers_supported_ = false;  // a server before 3.5: persistent parents, as Curator does
        continue;
      }
      if (rc == ZNONODE) return rc;  // the level above was reaped meanwhile
      if (!retry_after(session, rc, bound)) give_up(bound, "create of '" + prefix + "'", rc);
    }
    if (slash == std::string::npos) return ZOK;
  }
}

ZookeeperBackend::MadeEntry ZookeeperBackend::create_entry(Session& session, const NewEntry& entry,
                                                           const CallBudget& bound) {
  const auto& [parent, label, uuid, data, want_token, want_listing] = entry;
  const auto own_token = [&](const std::string& path) {
    return want_token ? read_token(session, path, bound, {session.weak_from_this(), path, "", ""}) : 0;
  };
  for (;;) {
    // The token comes with the create's answer (create2), or is read after it.
    Session::Creation creation{.path = parent + "/" + protected_name(uuid, label),
                               .data = data,
                               .flags = ZOO_EPHEMERAL_SEQUENTIAL,
                               .want_stat = want_token && create2_supported_};
    std::vector<std::string> children;
    int listed = ZNOTHING;
    const int rc = want_listing ? session.create_and_list(creation, parent, bound, &children, &listed)
                                : session.create(creation, bound);
    if (rc == ZUNIMPLEMENTED && creation.want_stat) {
      create2_supported_ = false;  // a server before 3.5
      continue;
    }
    if (rc == ZOK) {
      const auto token = creation.want_stat ? token_of(creation.stat) : own_token(creation.created);
      MadeEntry made{creation.created.substr(parent.size() + 1), token, std::nullopt};
      // A listing that failed is not retried here: the place's first look lists again.
      if (listed == ZOK) made.listing = std::move(children);
      return made;
    }
    if (rc == ZNONODE) {
      ensure_path(session, parent, bound);  // first use, or the server reaped the empty container
      continue;
    }
    check_session(session, rc);
    if (!connection_trouble(rc)) throw_error("create under '" + parent + "'", rc);
    if (auto mine = find_own(session, parent, uuid, bound)) return {*mine, own_token(parent + "/" + *mine), {}};
    // Not made: create it again (same protection id, so a second loss is resolved alike).
  }
}

std::uint64_t ZookeeperBackend::read_token(Session& session, const std::string& path, const CallBudget& bound,
                                           const Orphan& orphan) {
  for (;;) {
    Stat stat{};
    const int rc = bound.passed() ? ZOPERATIONTIMEOUT : session.exists(path, false, bound, &stat);
    if (rc == ZOK) return token_of(stat);
    if (rc == ZNONODE) throw QueueEntryGone{};
    if (!retry_after(session, rc, bound)) {
      remove_later(orphan);  // a node of ours without its token holds for nobody
      if (bound.stopped()) throw CallStopped{};
      unconfirmed("the fencing token of '" + path + "' (" + zerror(rc) + ")",
                  "its nodes are removed once the connection is back");
    }
  }
}

// After a create whose reply was lost: our node, if the server made it, found by the protection
// id; nullopt when it was not made. When that stays unknown past the bound (or its stop), hands
// the look-up to the background removal (which removes the node) and throws BackendUnavailable
// (CallStopped).
std::optional<std::string> ZookeeperBackend::find_own(Session& session, const std::string& parent,
                                                      const std::string& uuid, const CallBudget& bound) {
  for (;;) {
    std::vector<std::string> mine;
    // Past the bound (the create itself waited that long): the background's job, not the caller's.
    const int rc = bound.passed()        ? ZOPERATIONTIMEOUT
                   : session.connected() ? own_children(session, parent, uuid, bound, &mine)
                                         : ZCONNECTIONLOSS;
    if (rc == ZOK) return mine.empty() ? std::nullopt : std::optional(mine.front());
    if (!retry_after(session, rc, bound)) {
      // Still unknown: the background removal finds and removes it once the connection is back,
      // so it never waits in line (or holds) for nobody.
      remove_later({session.weak_from_this(), "", parent, uuid});
      if (bound.stopped()) throw CallStopped{};
      unconfirmed("a create under '" + parent + "' (" + zerror(rc) + ")",
                  "its node, if it was made, is removed once the connection is back");
    }
  }
}

std::vector<std::string> ZookeeperBackend::list(Session& session, const std::string& path, bool watch,
                                                const CallBudget& bound) {
  for (;;) {
    std::vector<std::string> children;
    const int rc = session.children(path, watch, bound, &children);
    if (rc == ZOK) return children;
    if (rc == ZNONODE) return {};
    if (!retry_after(session, rc, bound)) give_up(bound, "listing of '" + path + "'", rc);
  }
}

std::optional<std::string> ZookeeperBackend::read(Session& session, const std::string& path, bool watch,
                                                  const CallBudget& bound, Stat* stat) {
  for (;;) {
    std::string data;
    const int rc = session.get(path, watch, bound, &data, stat);
    if (rc == ZOK) return data;
    if (rc == ZNONODE) return std::nullopt;
    if (!retry_after(session, rc, bound)) give_up(bound, "read of '" + path + "'", rc);
  }
}

void ZookeeperBackend::remove_eventually(Session& session, const std::string& path) noexcept {
  // On a link that just left a call unanswered, the delete is sent but not waited for: the
  // background removal confirms it (its own delete finds the node gone, or removes it).
  const auto bound = session.silent() ? CallBudget(SteadyClock::now()) : session.short_budget();
  const int rc = session.remove(path, bound);
  if (!connection_trouble(rc)) return;  // removed, or gone with its session
  try {
    remove_later({session.weak_from_this(), path, "", ""});
  } catch (...) {
    // Out of memory: the node goes with the session.
  }
}

std::optional<bool> ZookeeperBackend::gone(Session& session, const std::string& path, const CallBudget& bound) {
  for (;;) {
    if (bound.passed()) return std::nullopt;  // the background removal's job now
    int rc = session.sync(path.substr(0, path.rfind('/')), bound);
    if (rc == ZOK) rc = session.exists(path, false, bound);
    if (rc == ZOK) return false;
    if (rc == ZNONODE) return true;
    if (!retry_after(session, rc, bound)) return std::nullopt;
  }
}

void ZookeeperBackend::wait_for_change(Session& session, const std::string& path, const CallBudget& caller,
                                       bool (*still_blocks)(const std::string&)) {
  PathWatch watch(connection_, path);
  // getData, not exists: a node already gone leaves no watch behind. The read that sets the
  // watch is the one that decides: a change between the look and the watch is not missed.
  const auto data = read(session, path, true, call_bound(session, caller));
  if (!data || (still_blocks && !still_blocks(*data))) return;
  watch.sleep(caller);
  check_session(session, ZOK);
}

std::unique_ptr<WakeArm> ZookeeperBackend::arm_on_change(Session& session, const std::string& path, Wake wake,
                                                         bool (*still_blocks)(const std::string&)) {
  // Registered before the call that sets the server's watch, as wait_for_change does.
  auto armed = std::make_unique<ArmedWatch>(connection_, std::make_unique<PathWatch>(connection_, path),
                                            std::move(wake), /*watch_set=*/false);
  session.arm_data_watch(path, still_blocks, armed->slot());
  return armed;
}

// One lease node per permit, all made in one multi (Curator's layout): the request must fit
// ZooKeeper's request limit (jute.maxbuffer, 1 MB by default) or the server refuses it every
// time. We allow at most kMaxZookeeperPermits per acquire, and a transaction of at most half
// that limit (long names and chroots make each node's path longer).
constexpr std::int64_t kMaxZookeeperPermits = 1000;
constexpr std::size_t kMaxTransactionBytes = 512 * 1024;

void ZookeeperBackend::check_lease_request(const QueueRequest& request, const std::string& lease_prefix,
                                           const std::string& lease_data) {
  if (request.permits > kMaxZookeeperPermits) {
    throw InvalidArgument("Semaphore '" + request.name + "': " + std::to_string(request.permits) +
                          " permits in one acquire; ZooKeeper takes at most " + std::to_string(kMaxZookeeperPermits) +
                          " (one node per permit, made in one transaction)");
  }
  // Per create: header and lengths (~40 bytes), the path with its sequence suffix, the data,
  // the ACL (scheme, id and perms; the digest id is the user plus a 28-byte hash).
  const std::size_t acl = 40 + connection_.settings().user.size() + 32;
  const std::size_t per_lease = 40 + lease_prefix.size() + kSequenceDigits + lease_data.size() + acl;
  const std::size_t bytes = per_lease * static_cast<std::size_t>(std::max<std::int64_t>(request.permits, 1)) + 1024;
  if (bytes > kMaxTransactionBytes) {
    throw InvalidArgument("Semaphore '" + request.name + "': " + std::to_string(request.permits) +
                          " permits make a ZooKeeper transaction of about " + std::to_string(bytes / 1024) +
                          " KiB with this name; at most " + std::to_string(kMaxTransactionBytes / 1024) + " KiB");
  }
}

std::unique_ptr<QueuePlace> ZookeeperBackend::join(const QueueRequest& request, bool try_once, Deadline deadline,
                                                   Standing& first) {
  return queue_step([&] {
    auto session = session_for(deadline);  // a live one: the last one's expiry may be why we join again
    auto place = request.kind == EntryKind::lease ? make_lease_place(*this, std::move(session), request, try_once)
                                                  : make_lock_place(*this, std::move(session), request);
    place->enter(deadline);
    try {
      first = place->look(deadline);
    } catch (...) {
      place->leave();
      throw;
    }
    return std::unique_ptr<QueuePlace>(std::move(place));
  });
}

}  // namespace turnstile::detail::zookeeper

extern "C" std::unique_ptr<turnstile::detail::Backend> turnstile_backend_factory_v2(
    const turnstile::detail::BackendUrl& url, const turnstile::ClientOptions& options,
    turnstile::detail::BackendReports& reports) {
  using namespace turnstile::detail::zookeeper;
  auto settings = parse_settings(url, options);
  settings.reports = &reports;
  return std::make_unique<ZookeeperBackend>(std::move(settings));
}
