// SPDX-License-Identifier: Apache-2.0
// The machine's host name, as holders record it beside their pid (every backend's entries,
// Consul's session names), read in one place.
#pragma once

#include <string>

namespace turnstile::detail {

// gethostname(2)'s answer, at most 255 bytes; "" when it cannot be read. Read on every call:
// a host may be renamed while a program runs, and callers that want one value keep it.
std::string host_name();

}  // namespace turnstile::detail
