// SPDX-License-Identifier: Apache-2.0
#include "take_hold.hpp"

#include <sys/signalfd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string_view>

#include "common.hpp"
#include "event_lines.hpp"
#include "namespace_notice.hpp"
#include "queue_messages.hpp"
#include "signals.hpp"

namespace turnstile::cli {

namespace {

// What is to be held: the primitive, its name, and how messages call it.
struct Wanted {
  Kind kind;
  std::string name;
  std::string what;
};

Wanted wanted_by(const RunOptions& options) {
  const Kind kind = options.lock    ? Kind::lock
                    : options.read  ? Kind::read
                    : options.write ? Kind::write
                    : options.elect ? Kind::election
                                    : Kind::semaphore;
  const std::string& name = hold_name(options);
  return {kind, name, what_is_held(kind, name, options)};
}

// How long acquire() may wait, counted from `started` (before connecting: --timeout bounds the
// whole wait).
Wait wait_for(const RunOptions& options, std::chrono::steady_clock::time_point started) {
  Wait wait = kTryOnce;
  if (!options.timeout_sec) {
    wait.emplace(std::nullopt);
  } else if (*options.timeout_sec > 0) {
    wait.emplace(started + std::chrono::ceil<std::chrono::steady_clock::duration>(
                               std::chrono::duration<double>(*options.timeout_sec)));
  }
  return wait;
}

// --connect-timeout, never more than a positive --timeout.
std::chrono::milliseconds connect_timeout(const RunOptions& options) {
  auto connect_within = std::chrono::duration<double>(options.connect_timeout_sec);
  if (options.timeout_sec && *options.timeout_sec > 0) {
    connect_within = std::min(connect_within, std::chrono::duration<double>(*options.timeout_sec));
  } else if (options.timeout_sec && !options.connect_timeout_given) {
    // --timeout 0 (flock -n): a try, connecting included, is not held up by a dead server
    // for the whole default connect timeout.
    connect_within = std::min(connect_within, std::chrono::duration<double>(kTryOnceConnect));
  }
  return std::max(std::chrono::milliseconds(1), std::chrono::ceil<std::chrono::milliseconds>(connect_within));
}

ClientOptions client_options_for(const RunOptions& options, StateChanges& changes) {
  ClientOptions client_options;
  client_options.on_hold_state = [&changes](const HoldStateChange& change) { changes.record(change); };
  if (options.ttl_sec) {
    client_options.ttl = std::chrono::ceil<std::chrono::milliseconds>(std::chrono::duration<double>(*options.ttl_sec));
  }
  client_options.holder_label = options.holder_label;
  client_options.connect_timeout = connect_timeout(options);
  client_options.on_event = event_handler_for(options);
  return client_options;
}

// -v: what it waits for, how long at most, who holds it and how many wait ahead.
void say_waiting(Client& client, const Wanted& wanted, const RunOptions& options) {
  const auto queue = look_at_queue(client, wanted.name);
  std::string text = "waiting for " + wanted.what + " on " + backend_shown(client);
  if (options.timeout_sec) text += " (at most " + seconds_text(*options.timeout_sec) + " s in all)";
  text += held_by(queue);
  if (queue.known && queue.waiters > 0) text += "; " + std::to_string(queue.waiters) + " waiting ahead";
  complain(text);
}

// Try once first: uncontended, that is the whole acquisition. On file:// a try is quick, so
// no signal thread is started for it; a network try waits for the server, and a signal
// meanwhile must still stop the command from starting (see AcquisitionGuard). Then the wait
// `wait` allows, unless a signal came during the try.
std::optional<Hold> try_then_wait(Client& client, const Wanted& wanted, const RunOptions& options, const Wait& wait,
                                  int signal_fd, std::optional<AcquisitionGuard>& guard) {
  if (guard) {
    guard->connected();
  } else if (!client.url().starts_with("file:")) {
    guard.emplace(signal_fd, wanted.name);
  }
  std::optional<Hold> hold;
  try {
    hold = acquire(client, wanted.kind, wanted.name, options, kTryOnce);
  } catch (const BackendUnavailable&) {
    // A refusal that may pass (a Redis Cluster's CLUSTERDOWN just after a node restarted):
    // with time left, the wait below tries again until the deadline, as lock() does. Not with
    // less than a second left: a backend gives an acquire's call about that much even past the
    // deadline (to hear the server's answer), and a server that did not answer the try would
    // take the run past its --timeout.
    if (!wait || (*wait && std::chrono::steady_clock::now() + std::chrono::seconds(1) > **wait)) throw;
  }
  if (hold || !wait || (guard && guard->token().stop_requested())) return hold;
  // The try used up the time (a server slow to answer it): a wait now would only overrun it.
  if (*wait && std::chrono::steady_clock::now() >= **wait) return hold;
  if (options.verbose) say_waiting(client, wanted, options);
  if (!guard) guard.emplace(signal_fd, wanted.name);
  return acquire(client, wanted.kind, wanted.name, options, wait, guard->token());
}

// The hold if it was taken, and the signal that came before it could be used (0 if none).
struct Taken {
  std::optional<Hold> hold;
  int cancelled_by = 0;
};

Taken take(Client& client, const Wanted& wanted, const RunOptions& options, const Wait& wait, int signal_fd,
           std::optional<AcquisitionGuard>& guard) {
  Taken taken;
  taken.hold = try_then_wait(client, wanted, options, wait, signal_fd, guard);
  // Any signal until now came before the hold was used: the command is not run.
  taken.cancelled_by = guard ? guard->disarm() : 0;
  if (const int unread = cancelling_signal(signal_fd); taken.cancelled_by == 0) taken.cancelled_by = unread;
  return taken;
}

// Says why the hold was not taken (busy, or the timeout ran out) and who holds it.
int not_held_status(Client& client, const std::string& name, const RunOptions& options) {
  const auto status = options.conflict_exit_code.value_or(kExitTimeout);
  if (options.quiet && !options.verbose) return status;  // -q: cron mails nothing for a skipped run
  const auto holder = held_by(look_at_queue(client, name));
  if (*options.timeout_sec == 0) {
    complain("'" + name + "' is busy" + holder);
  } else {
    char seconds[32];
    std::snprintf(seconds, sizeof seconds, "%g", *options.timeout_sec);
    complain("timed out after " + std::string(seconds) + " s waiting for '" + name + "'" + holder);
  }
  return status;
}

// Whether connecting may wait on a network: the URL given, else TURNSTILE_BACKEND's, else the
// embedded default.
bool connects_over_network(const RunOptions& options) {
  if (options.backend) return !options.backend->starts_with("file:");
  const char* from_environment = std::getenv("TURNSTILE_BACKEND");  // used when set and not empty
  return from_environment && *from_environment && !std::string_view(from_environment).starts_with("file:");
}

int connect_take_then(const RunOptions& options, const HeldBody& body, int signal_fd, const sigset_t& original_mask) {
  const auto wanted = wanted_by(options);
  StateChanges changes;
  const auto started = std::chrono::steady_clock::now();
  // A signal while connecting ends turnstile at once (128 + N), as one while waiting does.
  std::optional<AcquisitionGuard> guard;
  if (connects_over_network(options)) {
    guard.emplace(signal_fd, wanted.name, options.command.empty() ? "nothing was held" : "the command was not run");
  }
  auto client = connect_backend(options.backend, client_options_for(options, changes));
  if (default_backend_used(options.backend)) tell_namespace(client.url(), options.verbose);
  if (options.ttl_sec && *options.ttl_sec > 0 && client.url().starts_with("file:")) {
    complain("note: --ttl has no effect on " + client.url() +
             ": a hold on the embedded backend lasts exactly as long as its process");
  }
  if (options.hold_at_least && !client.can_release_after(options.semaphore.has_value())) {
    complain("--hold-at-least is not available on " + client.url() + (options.semaphore ? " for a Semaphore" : "") +
             " (file://, redis and etcd keep any hold after turnstile exits, consul:// a lock)");
    return kExitUsage;
  }
  auto [hold, cancelled_by] = take(client, wanted, options, wait_for(options, started), signal_fd, guard);
  if (cancelled_by != 0) {
    const bool run = !options.command.empty();
    complain(std::string(strsignal(cancelled_by)) + (run ? " before the command started; " : " before it was held; ") +
             give_back_after_signal(client, wanted.name, hold) + (run ? "; the command was not run" : ""));
    return 128 + cancelled_by;
  }
  if (!hold) return not_held_status(client, wanted.name, options);
  if (options.verbose) {
    const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - started;
    complain("got " + wanted.what + " on " + backend_shown(client) + " at " +
             iso8601(std::chrono::system_clock::now()) + " after " + seconds_text(waited.count()) +
             " s; fencing token " + std::to_string(hold->token));
  }
  return body(client, *hold, wanted.what, signal_fd, original_mask, changes);
}

}  // namespace

int take_hold_then(const RunOptions& options, const HeldBody& body) {
  sigset_t original_mask;
  const int signal_fd = handled_signals_to_fd(original_mask);
  if (signal_fd < 0) {
    complain(describe_errno("signalfd"));
    return kExitOsError;
  }
  try {
    return connect_take_then(options, body, signal_fd, original_mask);
  } catch (const Error& error) {
    complain(error.what());
    return exit_status_for(error);
  } catch (const EventsFileError& error) {
    complain(error.what());
    return kExitCannotCreate;
  } catch (const std::exception& error) {
    complain(error.what());
    return kExitOsError;
  }
}

}  // namespace turnstile::cli
