// SPDX-License-Identifier: Apache-2.0
// `turnstile gc`: removes what the backend keeps for names nobody uses (Client::collect_unused).
#include <cstdio>

#include "commands.hpp"
#include "common.hpp"

namespace turnstile::cli {

int gc_command(const GcOptions& options) {
  try {
    auto client = connect_backend(options.backend);
    const auto removed = client.collect_unused(options.prefix);
    if (!options.quiet) {
      for (const auto& what : removed) std::printf("removed %s\n", printable(what).c_str());
    }
    return 0;
  } catch (const Error& error) {
    complain(error.what());
    return exit_status_for(error);
  }
}

}  // namespace turnstile::cli
