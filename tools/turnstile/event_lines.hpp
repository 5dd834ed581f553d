// SPDX-License-Identifier: Apache-2.0
// What `run` and `hold` do with the library's events (ClientOptions::on_event): --events writes
// each as a JSON line, -v says the client's own (connections, failed renewals) in words.
#pragma once

#include <turnstile/turnstile.hpp>

#include "commands.hpp"

namespace turnstile::cli {

// One readable line for `event`, as -v prints it (without the "turnstile: " prefix).
std::string describe_event(const Event& event);

// The hook for `options` (empty when neither --events nor -v asks for one). Opens --events'
// FILE for appending (created 0666 less the umask); throws std::runtime_error when it cannot.
EventHandler event_handler_for(const RunOptions& options);

}  // namespace turnstile::cli
