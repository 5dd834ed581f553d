// For Etcd.ClientInStaticStorageEndsCleanlyAtExit: a Client in static storage, made in main
// (after the etcd module and gRPC's statics were loaded), still holding a Mutex when main
// returns. Usage: etcd_static_client URL NAME; exit status 0 expected.
#include <turnstile/turnstile.hpp>

#include <optional>

namespace {
std::optional<turnstile::Client> client;
std::optional<turnstile::Mutex> held;
}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  client.emplace(turnstile::Client::connect(argv[1]));
  auto released = client->mutex(std::string(argv[2]) + "-released");
  released.lock();
  released.unlock();
  held.emplace(client->mutex(argv[2]));
  held->lock();
  return 0;
}
