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
    if (options.verbose) {
      // A count, "0" included: a gc that removed nothing says so, and where it looked.
      std::fflush(stdout);
      complain("removed the state of " + std::to_string(removed.size()) + " unused name" +
               (removed.size() == 1 ? "" : "s") +
               (options.prefix.empty() ? "" : " under '" + printable(options.prefix) + "'") + " on " +
               backend_shown(client));
    }
    return 0;
  } catch (const Error& error) {
    complain(error.what());
    return exit_status_for(error);
  }
}

}  // namespace turnstile::cli
