// SPDX-License-Identifier: Apache-2.0
// What a zk:// URL and the client's options say: the servers, the chroot, the digest
// credentials, the session timeout asked for.
#pragma once

#include <chrono>
#include <string>

#include "core/backend.hpp"

namespace turnstile::detail::zookeeper {

using std::chrono::milliseconds;

struct Settings {
  std::string hosts;  // "host:port,host:port" as the C client takes it
  std::string root;   // the URL's chroot, "" or "/something" (no trailing '/')
  std::string user;   // digest credentials, optional
  std::string password;
  milliseconds session_timeout{30'000};  // asked for; the server may grant another
  std::string description;               // for messages
  std::string holder_label;              // ClientOptions::holder_label, kept in our nodes' data
  milliseconds connect_timeout{0};       // ClientOptions::connect_timeout; 0: see Connection::Connection
  // Where the session's pings and connections are reported (the client's, set by the factory;
  // it outlives the backend). None in tools and tests.
  BackendReports* reports = nullptr;
};

Settings parse_settings(const BackendUrl& url, const ClientOptions& options);

}  // namespace turnstile::detail::zookeeper
