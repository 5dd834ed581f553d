// SPDX-License-Identifier: Apache-2.0
// A hold of a queue entry (holds.cpp): what a granted place leaves behind. Its release takes the
// peers' key back (api.Lock's Unlock, or our holders out of api.Semaphore's `.lock`) and removes
// the entry in one transaction that first checks the entry is still ours.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backends/consul/layout.hpp"
#include "backends/consul/sessions.hpp"
#include "core/backend.hpp"
#include "core/loss_signal.hpp"

namespace turnstile::detail::consul {

class ConsulBackend;

struct HoldParts {
  std::string name;
  std::shared_ptr<Session> session;  // the main session, which holds the entry (and api.Lock's key)
  std::string entry_key;
  EntryValue value;
  std::vector<std::shared_ptr<Session>> permits;  // a lease's permit sessions
  std::uint64_t token = 0;                        // its fencing token
  std::shared_ptr<LossSignal> loss;
  // The occupancy key's ModifyIndex when our entry was the queue's only one (0: not known to
  // be): the release deletes that key if nobody joined since.
  std::uint64_t last_in = 0;
};

std::unique_ptr<BackendHold> make_hold(ConsulBackend& backend, HoldParts parts);

}  // namespace turnstile::detail::consul
