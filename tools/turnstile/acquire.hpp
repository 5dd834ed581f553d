// SPDX-License-Identifier: Apache-2.0
// What `turnstile run` and `turnstile hold` hold, whichever primitive it is, and how they take,
// name and (when lost) give it back.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <stop_token>
#include <string>

#include <turnstile/turnstile.hpp>

#include "commands.hpp"

namespace turnstile::cli {

// What the command runs under, whichever primitive it is.
struct Hold {
  std::uint64_t token = 0;
  std::stop_token lost;
  std::function<void()> release;  // throws HoldLost when the hold was lost meanwhile
  std::string receipt;            // names the entry for a release by another process ("" on file://)
  // Releases, leaving the name held that much longer (--hold-at-least; release_after).
  std::function<void(std::chrono::milliseconds)> release_after;
  std::string leader_value{};  // `elect`: the value this leader campaigned with ("" otherwise)
};

// Releases `hold` after its use: with --hold-at-least, the name stays held until DURATION after
// `held_from` (the command's start) where that is still ahead. Throws as Hold::release.
// Throws KeepUnconfirmed when the keep was not confirmed (the entry is left to expire).
void give_back(Hold& hold, const RunOptions& options, std::chrono::steady_clock::time_point held_from);

// --hold-at-least's keep went unconfirmed: nothing is released or retried; its text says so.
class KeepUnconfirmed : public turnstile::BackendUnavailable {
 public:
  using BackendUnavailable::BackendUnavailable;
};

enum class Kind { lock, read, write, semaphore, election };

// How long acquire() may wait: nothing (one try), until a deadline, or forever.
using Wait = std::optional<std::optional<std::chrono::steady_clock::time_point>>;
constexpr Wait kTryOnce = std::nullopt;
// With --timeout 0 and no --connect-timeout: how long connecting may take (a try-once acquire
// gets about as long to reach the server).
constexpr auto kTryOnceConnect = std::chrono::seconds(1);

// Takes the hold; nullopt when the wait ended first (deadline, or `stop` requested: the waiter
// has then left the queue).
std::optional<Hold> acquire(Client& client, Kind kind, const std::string& name, const RunOptions& options,
                            const Wait& wait, std::stop_token stop = {});

// The name given with --lock, --read, --write or --semaphore.
const std::string& hold_name(const RunOptions& o);

// What a hold is called in messages: "the lock 'jobs/nightly'", "a lease of the semaphore ...".
std::string what_is_held(Kind kind, const std::string& name, const RunOptions& options);

// Releases a hold known to be lost, waiting at most `bound`: what a cut-off connection cannot
// remove, the server's expiry will, and turnstile must not hang on it. The caller _exits next.
void release_within(Hold& hold, std::chrono::steady_clock::duration bound);

}  // namespace turnstile::cli
