// SPDX-License-Identifier: Apache-2.0
// From a URL's scheme to a connected backend: one table of schemes, the embedded file://
// backend built in, the network ones loaded from their own shared libraries on first use.
#pragma once

#include <concepts>
#include <memory>

#include "core/backend.hpp"
#include "core/telemetry.hpp"

namespace turnstile::detail {

// Deletes a backend, and only then lets go of the telemetry the backend reports to (it holds a
// reference to its BackendReports): whoever owns a backend owns what it refers to, so nobody
// can keep the one and drop the other.
class BackendDeleter {
 public:
  BackendDeleter() = default;
  // A backend that reports to no telemetry of its own (a unit test's): a plain delete.
  template <class Made>
  requires std::derived_from<Made, Backend> BackendDeleter(std::default_delete<Made>) {
  }  // NOLINT(google-explicit-constructor): as unique_ptr's
  explicit BackendDeleter(std::shared_ptr<Telemetry> reported_to) : reported_to_(std::move(reported_to)) {}
  void operator()(Backend* backend) {
    delete backend;
    reported_to_.reset();  // now, not when the emptied unique_ptr goes
  }

 private:
  std::shared_ptr<Telemetry> reported_to_;
};
using OwnedBackend = std::unique_ptr<Backend, BackendDeleter>;

struct ConnectedBackend {
  OwnedBackend backend;  // keeps `telemetry` alive while it lives
  // Works in a forked child (the embedded backend reopens its files there; the network
  // backends' threads and connections stay the parent's).
  bool usable_after_fork = false;
  // Its client's counters and event hook.
  std::shared_ptr<Telemetry> telemetry;
};

// Throws InvalidUrl for an unknown scheme, BackendNotBuilt when its library is not installed,
// and whatever the backend's factory throws.
ConnectedBackend connect_backend(const BackendUrl& url, const ClientOptions& options);

// The built-in entry of the table (src/backends/file).
std::unique_ptr<Backend> make_file_backend(const BackendUrl& url, const ClientOptions& options,
                                           BackendReports& reports);

}  // namespace turnstile::detail
