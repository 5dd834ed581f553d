// SPDX-License-Identifier: Apache-2.0
// For Etcd.ClientInStaticStorageEndsCleanlyAtExit: a Client in static storage, made in main
// (after the etcd module and gRPC's statics were loaded), still holding a Mutex when main
// returns. Usage: etcd_static_client URL NAME; exit status 0 expected.
// For Etcd.FailedConnectJustBeforeExitEndsCleanly: `etcd_static_client --refused URL` connects to
// an endpoint that refuses and returns from main as soon as the connect failed (as the CLI
// does); exit status 0 expected (3: the connect did not fail).
#include <turnstile/turnstile.hpp>

#include <optional>
#include <string_view>

namespace {
std::optional<turnstile::Client> client;
std::optional<turnstile::Mutex> held;
}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  if (std::string_view(argv[1]) == "--refused") {
    try {
      turnstile::Client::connect(argv[2]);
    } catch (const turnstile::BackendUnavailable&) {
      return 0;
    }
    return 3;
  }
  client.emplace(turnstile::Client::connect(argv[1]));
  auto released = client->mutex(std::string(argv[2]) + "-released");
  released.lock();
  released.unlock();
  held.emplace(client->mutex(argv[2]));
  held->lock();
  return 0;
}
