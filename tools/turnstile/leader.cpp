// SPDX-License-Identifier: Apache-2.0
// `turnstile leader NAME [--watch] [--json]`: the leader of an election (etcdctl elect -l).
#include <cmath>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <stop_token>
#include <thread>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "common.hpp"

namespace turnstile::cli {
namespace {

std::string render(const std::string& name, const std::optional<Leader>& leader, bool json) {
  if (!json) return leader ? printable(leader->value) + "\n" : std::string("(no leader)\n");
  nlohmann::ordered_json out = {{"name", name}, {"leader", leader.has_value()}};
  if (leader) {
    out["value"] = leader->value;
    out["fencing_token"] = leader->fencing_token;
    out["since"] = leader->since ? nlohmann::ordered_json(iso8601(*leader->since)) : nlohmann::ordered_json(nullptr);
  }
  // A value that is not UTF-8 (a peer may write any bytes) becomes U+FFFD rather than an error.
  return out.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

void print(const std::string& text) {
  std::fputs(text.c_str(), stdout);
  std::fflush(stdout);
}

// Requests `stop` when one of `signals` (blocked in every thread) arrives, until `done`.
void stop_on_signals(const sigset_t& signals, std::stop_source& stop, const std::stop_token& done) {
  const timespec tick{0, 100'000'000};
  while (!done.stop_requested()) {
    if (sigtimedwait(&signals, nullptr, &tick) > 0) return static_cast<void>(stop.request_stop());
  }
}

// --watch: the leader now, then one line per change, until a signal.
int watch(Election& election, const LeaderOptions& options, const sigset_t& signals) {
  std::stop_source stop;
  std::jthread listener([&](std::stop_token done) { stop_on_signals(signals, stop, done); });
  auto observer = election.observe();
  while (auto seen = observer.next(std::nullopt, stop.get_token())) print(render(options.name, *seen, options.json));
  return 0;
}

}  // namespace

int leader_command(const LeaderOptions& options) {
  if (!(std::isfinite(options.connect_timeout_sec) && options.connect_timeout_sec > 0 &&
        options.connect_timeout_sec <= 1e9)) {
    complain("--connect-timeout must be a number of seconds, more than 0 and at most 1e9");
    return kExitUsage;
  }
  // Blocked before any thread exists (a network client starts some): they all come to the
  // listener of --watch.
  sigset_t signals;
  sigemptyset(&signals);
  if (options.watch) {
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&signals, sig);
    pthread_sigmask(SIG_BLOCK, &signals, nullptr);
    std::signal(SIGPIPE, SIG_IGN);
  }
  try {
    ClientOptions client_options;
    client_options.connect_timeout =
        std::chrono::ceil<std::chrono::milliseconds>(std::chrono::duration<double>(options.connect_timeout_sec));
    auto client = connect_backend(options.backend, client_options);
    auto election = client.election(options.name);
    if (options.watch) return watch(election, options, signals);
    const auto leader = election.leader();
    // Nobody leads: nothing on stdout in text (`v=$(turnstile leader NAME)` is empty), exit 1.
    if (leader || options.json) print(render(options.name, leader, options.json));
    return leader ? 0 : 1;
  } catch (const Error& error) {
    complain(error.what());
    return exit_status_for(error);
  }
}

}  // namespace turnstile::cli
