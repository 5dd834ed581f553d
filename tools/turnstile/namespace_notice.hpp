// SPDX-License-Identifier: Apache-2.0
// Which namespace the embedded default is: the host-wide directory every member of its group
// and root share, or a private one per user (where `sudo turnstile` and the user's own
// `turnstile` do not exclude each other). Said where it bites: with -v, and under sudo.
#pragma once

#include <optional>
#include <string>

namespace turnstile::cli {

// Whether the backend is the embedded default: neither --backend nor TURNSTILE_BACKEND gave one.
bool default_backend_used(const std::optional<std::string>& backend_option);

// For the default backend `url`: with `verbose`, a line naming the directory and whose
// namespace it is; under sudo (SUDO_UID set and not this user), when the default is private,
// a one-line notice that this is root's (this user's) namespace, not the invoking user's.
void tell_namespace(const std::string& url, bool verbose);

}  // namespace turnstile::cli
