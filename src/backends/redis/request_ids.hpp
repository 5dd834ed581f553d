// SPDX-License-Identifier: Apache-2.0
// Request numbers of one client of the Redis backend, and the watermark of each key.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>

namespace turnstile::detail::redis {

// Request numbers: unique per client (its prefix is drawn when the client connects, so forked
// processes differ) and growing. Per key, the numbers still in flight (not yet answered, or
// given up and not yet retired) are kept and sent with every call that may create or change
// something ("<client>:<n>:<low>:<keep ms>:<open>", see common_prelude.lua): every request
// below <low> but those open is settled, so a copy of one delivered late changes nothing.
// <keep ms> is how long the server must remember this client's requests (2 TTLs, at least
// 2 minutes: docs/backends/redis.md, how it works): a record is never kept shorter than any request
// written to it asked.
class RequestIds {
 public:
  explicit RequestIds(std::int64_t keep_ms) : keep_(":" + std::to_string(keep_ms)) {
    std::random_device random;
    std::snprintf(prefix_, sizeof prefix_, "%08x%08x%08x", random(), random(), random());
  }
  // A new request on `key`, in flight until settle().
  std::uint64_t open(const std::string& key) {
    std::lock_guard lock(mutex_);
    in_flight_[key].insert(++count_);
    return count_;
  }
  void settle(const std::string& key, std::uint64_t n) {
    std::lock_guard lock(mutex_);
    const auto it = in_flight_.find(key);
    if (it == in_flight_.end()) return;
    it->second.erase(n);
    if (it->second.empty()) in_flight_.erase(it);
  }
  std::string id(std::uint64_t n) const { return prefix_ + std::string(":") + std::to_string(n); }
  // "<client>:<n>:<low>:<keep ms>:<open>": every request of this client on `key` below <low>
  // (past its last one) is settled but those listed in <open> (its in flight ones, n among
  // them), so a long waiter does not pin the watermark (see common_prelude.lua).
  std::string marked(const std::string& key, std::uint64_t n) {
    std::lock_guard lock(mutex_);
    std::set<std::uint64_t> open{n};
    if (const auto it = in_flight_.find(key); it != in_flight_.end()) open.insert(it->second.begin(), it->second.end());
    std::string listed;
    for (const auto e : open) listed += (listed.empty() ? "" : ",") + std::to_string(e);
    return id(n) + ":" + std::to_string(std::max(count_, n) + 1) + keep_ + ":" + listed;
  }

 private:
  char prefix_[25];
  std::string keep_;  // ":<keep ms>"
  std::mutex mutex_;
  std::uint64_t count_ = 0;
  std::map<std::string, std::set<std::uint64_t>> in_flight_;
};

}  // namespace turnstile::detail::redis
