#include "common.hpp"

#include <cstdio>
#include <cstdlib>

namespace turnstile::cli {

void complain(const std::string& message) { std::fprintf(stderr, "turnstile: %s\n", message.c_str()); }

int exit_status_for(const Error& error) {
  switch (error.code()) {
    case ErrorCode::invalid_argument:
    case ErrorCode::invalid_url:
    case ErrorCode::backend_not_built:
    // The name is in use in another mode or with another limit: the invocation has to change.
    case ErrorCode::kind_mismatch:
    case ErrorCode::limit_mismatch:
      return kExitUsage;
    case ErrorCode::access_denied:
      return kExitNoPermission;
    default:
      return kExitUnavailable;
  }
}

Client connect_backend(const std::optional<std::string>& url, ClientOptions options) {
  return url ? Client::connect(*url, std::move(options)) : Client::connect(std::move(options));
}

}  // namespace turnstile::cli
