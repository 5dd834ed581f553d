// SPDX-License-Identifier: Apache-2.0
// What `turnstile run` and `turnstile hold` share: the signals blocked and read from a
// signalfd, the connection, the hold taken (one try, then the wait --timeout allows), and what
// is said when it is not.
#pragma once

#include <csignal>
#include <functional>
#include <string>

#include <turnstile/turnstile.hpp>

#include "acquire.hpp"
#include "commands.hpp"
#include "state_changes.hpp"

namespace turnstile::cli {

// What run and hold do with a hold once it is taken; returns turnstile's exit status.
using HeldBody = std::function<int(Client& client, Hold& hold, const std::string& what, int signal_fd,
                                   const sigset_t& original_mask, StateChanges& changes)>;

// Connects, takes the hold (one try first, then the wait --timeout allows), and hands it to
// `body`; the exit status when it is not taken (busy, a signal first, an error).
int take_hold_then(const RunOptions& options, const HeldBody& body);

}  // namespace turnstile::cli
