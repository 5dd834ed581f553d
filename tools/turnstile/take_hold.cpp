#include "take_hold.hpp"

#include <sys/signalfd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>

#include "common.hpp"
#include "queue_messages.hpp"
#include "signals.hpp"

namespace turnstile::cli {

int take_hold_then(const RunOptions& options, const HeldBody& body) {
  const Kind kind = options.lock ? Kind::lock : options.read ? Kind::read : options.write ? Kind::write : Kind::semaphore;
  const std::string name = options.lock ? *options.lock
                           : options.read ? *options.read
                           : options.write ? *options.write
                                           : *options.semaphore;
  const auto what = what_is_held(kind, name, options);

  // Block before any thread exists so that every thread inherits the mask and the signals
  // wait in the signalfd; the child gets the original mask back before exec.
  sigset_t handled, original_mask;
  sigemptyset(&handled);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD, SIGTSTP, SIGCONT, SIGTTIN, SIGTTOU}) {
    sigaddset(&handled, sig);
  }
  pthread_sigmask(SIG_BLOCK, &handled, &original_mask);
  const int signal_fd = signalfd(-1, &handled, SFD_CLOEXEC);
  if (signal_fd < 0) {
    complain(describe_errno("signalfd"));
    return kExitOsError;
  }

  try {
    StateChanges changes;
    ClientOptions client_options;
    client_options.on_hold_state = [&changes](const HoldStateChange& change) { changes.record(change); };
    if (options.ttl_sec) {
      client_options.ttl = std::chrono::ceil<std::chrono::milliseconds>(std::chrono::duration<double>(*options.ttl_sec));
    }
    client_options.holder_label = options.holder_label;
    // The deadline counts from before connecting: --timeout bounds the whole wait.
    const auto started = std::chrono::steady_clock::now();
    Wait wait = kTryOnce;
    if (!options.timeout_sec) {
      wait.emplace(std::nullopt);
    } else if (*options.timeout_sec > 0) {
      wait.emplace(started +
                   std::chrono::ceil<std::chrono::steady_clock::duration>(std::chrono::duration<double>(*options.timeout_sec)));
    }
    auto connect_within = std::chrono::duration<double>(options.connect_timeout_sec);
    if (options.timeout_sec && *options.timeout_sec > 0) {
      connect_within = std::min(connect_within, std::chrono::duration<double>(*options.timeout_sec));
    } else if (options.timeout_sec && !options.connect_timeout_given) {
      // --timeout 0 (flock -n): a try, connecting included, is not held up by a dead server
      // for the whole default connect timeout.
      connect_within = std::min(connect_within, std::chrono::duration<double>(kTryOnceConnect));
    }
    client_options.connect_timeout =
        std::max(std::chrono::milliseconds(1), std::chrono::ceil<std::chrono::milliseconds>(connect_within));
    auto client = connect_backend(options.backend, std::move(client_options));
    if (options.ttl_sec && *options.ttl_sec > 0 && client.url().starts_with("file:")) {
      complain("note: --ttl has no effect on " + client.url() +
               ": a hold on the embedded backend lasts exactly as long as its process");
    }
    // Try once first: uncontended, that is the whole acquisition. On file:// a try is quick, so
    // no signal thread is started for it; a network try waits for the server, and a signal
    // meanwhile must still stop the command from starting (see AcquisitionGuard).
    std::optional<AcquisitionGuard> guard;
    if (!client.url().starts_with("file:")) guard.emplace(signal_fd, name);
    auto hold = acquire(client, kind, name, options, kTryOnce);
    if (!hold && wait && !(guard && guard->token().stop_requested())) {
      if (options.verbose) {
        const auto queue = look_at_queue(client, name);
        std::string text = "waiting for " + what + " on " + client.url();
        if (options.timeout_sec) text += " (at most " + seconds_text(*options.timeout_sec) + " s in all)";
        text += held_by(queue);
        if (queue.known && queue.waiters > 0) text += "; " + std::to_string(queue.waiters) + " waiting ahead";
        complain(text);
      }
      if (!guard) guard.emplace(signal_fd, name);
      hold = acquire(client, kind, name, options, wait, guard->token());
    }
    // Any signal until now came before the hold was used: the command is not run.
    int cancelled_by = guard ? guard->disarm() : 0;
    if (const int unread = cancelling_signal(signal_fd); cancelled_by == 0) cancelled_by = unread;
    if (cancelled_by != 0) {
      const bool run = !options.command.empty();
      complain(std::string(strsignal(cancelled_by)) + (run ? " before the command started; " : " before it was held; ") +
               give_back_after_signal(client, name, hold) + (run ? "; the command was not run" : ""));
      return 128 + cancelled_by;
    }
    if (!hold) {
      const auto holder = held_by(look_at_queue(client, name));
      if (*options.timeout_sec == 0) {
        complain("'" + name + "' is busy" + holder);
      } else {
        char seconds[32];
        std::snprintf(seconds, sizeof seconds, "%g", *options.timeout_sec);
        complain("timed out after " + std::string(seconds) + " s waiting for '" + name + "'" + holder);
      }
      return options.conflict_exit_code.value_or(kExitTimeout);
    }
    if (options.verbose) {
      const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - started;
      complain("got " + what + " on " + client.url() + " at " + iso8601(std::chrono::system_clock::now()) + " after " +
               seconds_text(waited.count()) + " s; fencing token " + std::to_string(hold->token));
    }
    return body(client, *hold, what, signal_fd, original_mask, changes);
  } catch (const Error& error) {
    complain(error.what());
    return exit_status_for(error);
  } catch (const std::exception& error) {
    complain(error.what());
    return kExitOsError;
  }
}

}  // namespace turnstile::cli
