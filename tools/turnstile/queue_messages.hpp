// SPDX-License-Identifier: Apache-2.0
// What turnstile says about a name's queue: who holds it, how many wait, and what became of
// this process's entry after a signal.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include <turnstile/turnstile.hpp>

#include "acquire.hpp"

namespace turnstile::cli {

// Who is in the queue of a name, as far as inspect tells; `known` is false when it failed
// (a message about the queue must not fail for it).
struct QueueView {
  bool known = false;
  std::string holder;  // holder_text of the first holder, "" when none
  std::size_t holders = 0, waiters = 0;
  // An entry carries this process's pid (turnstile makes one acquisition per process): after a
  // cancelled wait, its leaving has not been confirmed.
  bool has_ours = false;
};

QueueView look_at_queue(Client& client, const std::string& name);

// After a signal cancelled the acquisition: releases a hold taken meanwhile, and says what became
// of it or of the entry the cancelled wait left. Only what the server confirmed is told as done:
// a leave or a release is a network call that may go unanswered (then retried in the
// background, or ended by the entry's TTL or the session's end).
std::string give_back_after_signal(Client& client, const std::string& name, std::optional<Hold>& hold);

// "; held by LABEL pid@host since TIME (and N more)", or "" when no holder is known.
std::string held_by(const QueueView& view);

// Seconds as messages show them: three significant digits.
std::string seconds_text(double seconds);

}  // namespace turnstile::cli
