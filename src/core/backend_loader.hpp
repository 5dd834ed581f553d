// SPDX-License-Identifier: Apache-2.0
// From a URL's scheme to a connected backend: one table of schemes, the embedded file://
// backend built in, the network ones loaded from their own shared libraries on first use.
#pragma once

#include <memory>

#include "core/backend.hpp"
#include "core/telemetry.hpp"

namespace turnstile::detail {

struct ConnectedBackend {
  std::unique_ptr<Backend> backend;
  // Works in a forked child (the embedded backend reopens its files there; the network
  // backends' threads and connections stay the parent's).
  bool usable_after_fork = false;
  // Its client's counters and event hook; the backend holds a reference to its BackendReports,
  // so this outlives it.
  std::shared_ptr<Telemetry> telemetry;
};

// Throws InvalidUrl for an unknown scheme, BackendNotBuilt when its library is not installed,
// and whatever the backend's factory throws.
ConnectedBackend connect_backend(const BackendUrl& url, const ClientOptions& options);

// The built-in entry of the table (src/backends/file).
std::unique_ptr<Backend> make_file_backend(const BackendUrl& url, const ClientOptions& options,
                                           BackendReports& reports);

}  // namespace turnstile::detail
