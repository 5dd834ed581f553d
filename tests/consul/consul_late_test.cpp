// Consul writes that arrive late, or after the client's session was destroyed (issue 22, items
// 8, 9, 10, 14), against the Consul test stand-in: a write its sender gave up on changes nothing,
// every counter change applies at most once, and a session gone on the server reads as the
// entry or hold gone, never as the server unreachable.
#include <gtest/gtest.h>

#include <future>

#include <nlohmann/json.hpp>

#include "support/server_tests.hpp"
#include "support/tcp_proxy.hpp"

namespace {

using namespace std::chrono_literals;
using server_tests::quoted;
using server_tests::shell;

std::string url() { return server_tests::read_first_line(TURNSTILE_CONSUL_URL_FILE); }
std::string base() {
  auto rest = url().substr(std::string("consul://").size());
  return "http://" + rest.substr(0, rest.find('?'));
}
std::string curl(const std::string& method, const std::string& path, const std::string& body = "") {
  return shell("curl -s -X " + method + " --data-binary " + quoted(body) + " " + quoted(base() + path));
}
std::string unique(const std::string& what) {
  return "consul-late/" + std::to_string(getpid()) + "-" + std::to_string(std::rand()) + "/" + what;
}
turnstile::ClientOptions labelled(const std::string& label) {
  turnstile::ClientOptions options;
  options.holder_label = label;
  return options;
}
// Destroys every session named `label` (the client's, as ClientOptions::holder_label names them),
// as an operator's `consul session destroy` would: how many.
int destroy_sessions(const std::string& label) {
  const auto sessions = nlohmann::json::parse(curl("GET", "/v1/session/list"), nullptr, false);
  int destroyed = 0;
  for (const auto& session : sessions) {
    if (session.value("Name", std::string()) != label) continue;
    curl("PUT", "/v1/session/destroy/" + session.value("ID", std::string()));
    ++destroyed;
  }
  return destroyed;
}

// Item 14: `PUT ?acquire` with a session the server no longer has answers HTTP 500 'invalid
// session "ID"' (kvsLockTxn). A downgrade then is a hold lost, not a server unreachable. Without
// a lock-delay: with one, the acquire is refused before the session is looked at (kvsPreApply).
TEST(ConsulLate, ADowngradeAfterTheSessionWasDestroyedIsHoldLost) {
  const auto label = unique("downgrade-label");
  const auto without_delay = url().substr(0, url().find('?')) + "?lock_delay=0";
  auto client = turnstile::Client::connect(without_delay, labelled(label));
  auto mutex = client.shared_mutex(unique("downgrade"));
  mutex.lock();
  mutex.lock_shared();
  ASSERT_GE(destroy_sessions(label), 1);
  EXPECT_THROW(mutex.release(), turnstile::HoldLost);
  mutex.unlock_shared();
}

// Item 14: a PermitCounter waiter whose session was destroyed joins the line again (a new
// session) rather than fail with BackendUnavailable.
TEST(ConsulLate, ACounterWaiterWhoseSessionWasDestroyedWaitsOnNotUnavailable) {
  const auto label = unique("counter-label");
  auto client = turnstile::Client::connect(url(), labelled(label));
  auto counter = client.permit_counter(unique("counter"));
  ASSERT_FALSE(counter.try_acquire(1));  // made the session, took nothing
  ASSERT_GE(destroy_sessions(label), 1);
  EXPECT_FALSE(counter.try_acquire_for(500ms, 1));
  EXPECT_EQ(counter.add_permits(1), 1);
  EXPECT_TRUE(counter.try_acquire_for(2s, 1));
}

}  // namespace
