// SPDX-License-Identifier: Apache-2.0
// Client::names_in_use: a backend's scan proposes names, inspect counts their holders and waiters,
// so every backend lists by the same queue predicate that `turnstile inspect NAME` shows.
#include "core/names_in_use.hpp"

#include <algorithm>

#include "core/client_state.hpp"

namespace turnstile {
namespace {

// At most this many names are listed, and a backend's scan proposes at most this many: a listing
// of a huge keyspace stays bounded in time and memory (`truncated` says when it stopped).
constexpr std::size_t kMostNames = 10'000;
// Candidates inspected in one Backend::inspect_each: few round trips where a backend can ask for
// many names at once (Redis pipelines them), a short wait past the last name listed otherwise.
constexpr std::size_t kInspectedAtOnce = 200;

// A prefix must be the beginning of some valid name: no control character, no leading '/', no
// empty segment before its end, at most a name's 255 bytes. "jobs/" and "jobs/ni" are fine.
void check_prefix(std::string_view prefix) {
  const auto reject = [&](const std::string& why) { throw InvalidArgument("invalid name prefix: " + why); };
  if (prefix.size() > 255) reject("it is " + std::to_string(prefix.size()) + " bytes long, a name's limit is 255");
  if (prefix.starts_with('/')) reject("'" + std::string(prefix) + "' starts with '/'");
  if (prefix.find("//") != std::string_view::npos) reject("'" + std::string(prefix) + "' has an empty segment");
  for (const char c : prefix) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7F) reject("it contains the control character " + std::to_string(byte));
  }
}

bool valid_name(const std::string& name) {
  try {
    detail::validate_name(name);
    return true;
  } catch (const InvalidArgument&) {
    return false;  // a key a peer wrote that no turnstile name maps to
  }
}

}  // namespace

NamesInUse Client::names_in_use(std::string_view prefix, std::size_t max_names, SteadyClock::time_point deadline) {
  return detail::names_in_use(state_->backend(), prefix, max_names, deadline);
}

namespace detail {

NamesInUse names_in_use(Backend& backend, std::string_view prefix, std::size_t max_names, Deadline deadline) {
  check_prefix(prefix);
  if (max_names < 1 || max_names > kMostNames) {
    throw InvalidArgument("the most names to list must be 1 to " + std::to_string(kMostNames) + ", got " +
                          std::to_string(max_names));
  }
  auto found = backend.queue_names(std::string(prefix), kMostNames, deadline);
  auto& candidates = found.names;
  std::erase_if(candidates, [&](const std::string& name) { return !name.starts_with(prefix) || !valid_name(name); });
  std::sort(candidates.begin(), candidates.end());
  candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
  NamesInUse result;
  result.truncated = !found.complete;
  for (std::size_t start = 0; start < candidates.size(); start += kInspectedAtOnce) {
    if (result.names.size() == max_names) {
      result.truncated = true;  // candidates after the last one listed (they may be empty)
      break;
    }
    const auto end = std::min(candidates.size(), start + kInspectedAtOnce);
    const std::vector<std::string> batch(candidates.begin() + start, candidates.begin() + end);
    const auto queues = backend.inspect_each(batch, deadline);
    for (std::size_t i = 0; i < batch.size(); ++i) {
      const auto& queue = queues[i];
      if (queue.holders.empty() && queue.waiters.empty()) continue;
      if (result.names.size() == max_names) {
        result.truncated = true;
        break;
      }
      result.names.push_back({batch[i], queue.mode, queue.limit, queue.holders.size(), queue.waiters.size()});
    }
  }
  return result;
}

}  // namespace detail
}  // namespace turnstile
