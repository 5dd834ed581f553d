// SPDX-License-Identifier: Apache-2.0
// What `run` and `hold` do with the library's events (ClientOptions::on_event): --events writes
// each as a JSON line, -v says the client's own (connections, failed renewals) in words.
#pragma once

#include <stdexcept>

#include <turnstile/turnstile.hpp>

#include "commands.hpp"

namespace turnstile::cli {

// One readable line for `event`, as -v prints it (without the "turnstile: " prefix).
std::string describe_event(const Event& event);

// --events' FILE cannot be opened (a missing directory, a directory, no permission, a FIFO
// nobody reads): the user's output file cannot be made, exit 73 (EX_CANTCREAT).
struct EventsFileError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The hook for `options` (empty when neither --events nor -v asks for one). Opens --events'
// FILE for appending (created 0666 less the umask); throws EventsFileError when it cannot.
EventHandler event_handler_for(const RunOptions& options);

}  // namespace turnstile::cli
