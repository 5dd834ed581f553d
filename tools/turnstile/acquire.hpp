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
};

enum class Kind { lock, read, write, semaphore };

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
