// SPDX-License-Identifier: Apache-2.0
// Election: one leader among candidates, with a value everybody can read.
//
//   ./example_election [file:///some/dir]   (default: Client::connect(), i.e. $TURNSTILE_BACKEND
//                                            or the embedded default directory)
//
// Shows campaign() (waits until leading), campaign_for() (gives up after a while),
// campaign_async() (waits without a thread), proclaim() (the leader changes its value, keeping
// its fencing token), leader() (anyone reads the leader), observe() (a stream of leader
// changes) and resign() (the next candidate in line leads). Leadership is a hold: lost_token()
// tells when it may have been lost, as a lock's does.
#include <turnstile/turnstile.hpp>

#include <chrono>
#include <cstdio>
#include <optional>
#include <stop_token>
#include <string>
#include <thread>

namespace {

void print_leader(const char* who, const std::optional<turnstile::Leader>& leader) {
  if (!leader) {
    std::printf("%s: nobody leads\n", who);
    return;
  }
  std::printf("%s: '%s' leads (fencing token %llu)%s\n", who, leader->value.c_str(),
              static_cast<unsigned long long>(leader->fencing_token), leader->ours ? ", that is us" : "");
}

}  // namespace

int main(int argc, char** argv) try {
  using namespace std::chrono_literals;
  auto client = argc > 1 ? turnstile::Client::connect(argv[1]) : turnstile::Client::connect();
  const std::string name = "services/scheduler";

  // An observer, as a dashboard would run one: the current leader first, then each change it
  // sees (a quick succession may be reported as its last state only).
  auto observer = client.election(name).observe();
  std::jthread watching([&observer](std::stop_token stop) {
    while (auto seen = observer.next(std::nullopt, stop)) print_leader("observer", *seen);
  });

  // Two candidates (in one process here; usually one per service instance).
  auto alpha = client.election(name);
  alpha.campaign("alpha.internal:8080");  // nobody leads yet: alpha leads at once
  std::stop_callback on_loss(alpha.lost_token(), [] { std::puts("alpha: leadership lost, stop leading work"); });
  const auto alpha_token = alpha.fencing_token();

  auto beta = client.election(name);
  if (!beta.campaign_for("beta.internal:8080", 100ms)) std::puts("beta: not leading within 100 ms");
  print_leader("beta", beta.leader());

  // The leader moves: a new value under the same fencing token.
  alpha.proclaim("alpha.internal:9090");
  print_leader("beta", beta.leader());

  // beta waits in line without a thread; alpha steps down and beta leads next.
  auto campaign = beta.campaign_async("beta.internal:8080");
  alpha.resign();
  if (campaign.get()) {
    std::printf("beta: leading, token %llu > alpha's %llu\n", static_cast<unsigned long long>(beta.fencing_token()),
                static_cast<unsigned long long>(alpha_token));
  }
  print_leader("beta", beta.leader());
  beta.resign();
  print_leader("alpha", alpha.leader());

  std::this_thread::sleep_for(50ms);  // let the observer print the last change before it stops
  return 0;
} catch (const turnstile::Error& error) {  // a bad URL, a server that cannot be reached, ...
  std::fprintf(stderr, "%s\n", error.what());
  return error.code() == turnstile::ErrorCode::invalid_url ? 64 : 69;  // EX_USAGE, EX_UNAVAILABLE
}
