// SPDX-License-Identifier: Apache-2.0
#include "namespace_notice.hpp"

#include <unistd.h>

#include <cstdlib>

#include <turnstile/turnstile.hpp>

#include "common.hpp"

namespace turnstile::cli {

bool default_backend_used(const std::optional<std::string>& backend_option) {
  const char* env = std::getenv("TURNSTILE_BACKEND");
  return !backend_option && !(env && *env);
}

void tell_namespace(const std::string& url, bool verbose) {
  const bool host_wide = url == std::string("file://") + Client::host_wide_directory;
  const auto uid = std::to_string(::geteuid());
  if (verbose) {
    complain("using " + url +
             (host_wide ? " (the host-wide namespace: root and its group's members share it)"
                        : " (uid " + uid + "'s private namespace: other users' names are not these)"));
  }
  const char* sudo_uid = std::getenv("SUDO_UID");
  if (host_wide || !sudo_uid || !*sudo_uid || uid == sudo_uid) return;
  complain("note: under sudo this is uid " + uid + "'s private namespace (" + url + "), apart from uid " + sudo_uid +
           "'s; names here do not exclude theirs (man turnstile: DEFAULT BACKEND)");
}

}  // namespace turnstile::cli
