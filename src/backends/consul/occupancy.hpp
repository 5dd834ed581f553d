// SPDX-License-Identifier: Apache-2.0
// The end of a name's occupancy key (turnstile/o/NAME, keys.hpp): whoever leaves the queue last
// removes it, so that no key outlives the queue it marks.
#pragma once

#include <chrono>
#include <string>

namespace turnstile::detail::consul {

class ConsulBackend;

// After our entry left NAME's queue: when the queue is empty, deletes the occupancy key by CAS
// on the index one consistent read saw it at together with the empty queue. Every join writes
// that key in the transaction that adds its entry, so a newcomer since moved the index and keeps
// its occupancy (the CAS is refused). A failure leaves the key, as before (an exclusive join then
// takes the ordinary way in; nothing is unsafe about a key left behind). Never throws.
void end_occupancy_if_last(ConsulBackend& backend, const std::string& name, std::chrono::milliseconds timeout) noexcept;

}  // namespace turnstile::detail::consul
