// SPDX-License-Identifier: Apache-2.0
#include "core/host_name.hpp"

#include <unistd.h>

namespace turnstile::detail {

std::string host_name() {
  // One byte more than gethostname may fill, zeroed: the name is terminated even when POSIX
  // lets a truncated one go without its '\0'.
  char buffer[257] = {};
  if (gethostname(buffer, sizeof buffer - 1) != 0) return {};
  return buffer;
}

}  // namespace turnstile::detail
