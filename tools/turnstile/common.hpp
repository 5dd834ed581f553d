// SPDX-License-Identifier: Apache-2.0
// What the subcommands of the `turnstile` command share: exit statuses, error reporting,
// connecting to a backend.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <string_view>

#include <turnstile/turnstile.hpp>

namespace turnstile::cli {

// sysexits(3) values, as docs/cli.md's table of exit statuses promises.
inline constexpr int kExitUsage = 64;         // bad usage, bad name, bad URL
inline constexpr int kExitUnavailable = 69;   // the backend cannot be reached
inline constexpr int kExitHoldLost = 70;      // the hold was lost while the command ran
inline constexpr int kExitOsError = 71;       // fork/pipe/signalfd failed
inline constexpr int kExitCannotCreate = 73;  // an output file (--events FILE) cannot be made
inline constexpr int kExitTimeout = 75;       // the timeout passed before acquisition
inline constexpr int kExitNoPermission = 77;  // refused: credentials, ACL, a state directory we may not use
inline constexpr int kExitCannotExecute = 126;
inline constexpr int kExitNotFound = 127;

// Text from the backend — written by any peer — as shown on a terminal: each control or
// formatting character becomes \u{...}, each byte that is not UTF-8 \xNN, and a backslash \\.
std::string printable(std::string_view text);

// The length of the well-formed multi-byte UTF-8 sequence at text[i] (RFC 3629: no overlong
// forms, no surrogates, nothing above U+10FFFF), its code point in `code_point`; 0 for an ASCII
// byte or anything not well formed.
std::size_t utf8_length(std::string_view text, std::size_t i, char32_t& code_point);

// ISO 8601 in UTC with milliseconds: 2024-05-01T10:00:00.123Z.
std::string iso8601(std::chrono::system_clock::time_point when);

// Why `name` is not a valid name by the rules Client documents ('/'-separated non-empty
// segments, no '.' or '..', at most 255 bytes of UTF-8 without control characters), in the
// library's words; "" when it is valid. For inspect of a directory that does not exist, which
// must not connect (connecting creates it).
std::string name_problem(std::string_view name);

// "<what>: <strerror(errno)>", for an operating-system call that failed.
std::string describe_errno(const std::string& what);

// Prints "turnstile: <message>" on stderr.
void complain(const std::string& message);

// The exit status for a library error: the caller's fault (64) or the backend's (69).
int exit_status_for(const Error& error);

// The backend as messages name it: client.url(), and for a consul:// URL without an agent the
// agent Consul's environment names (CONSUL_HTTP_ADDR, else Consul's default 127.0.0.1:8500).
std::string backend_shown(const Client& client);

// A release at the end that the server did not confirm (BackendUnavailable), as turnstile is
// about to exit: says once what happens next (the client's end tries it once more, for up to
// a second; otherwise the server's expiry frees the name), and keeps that last try from
// reporting a give-up on top of it.
void say_release_unconfirmed(Client& client, const std::string& what, const Error& error);

// Client::connect(url) with options; without a URL, what Client::connect() would use
// (TURNSTILE_BACKEND, else the embedded default), so options such as the TTL still apply.
Client connect_backend(const std::optional<std::string>& url, ClientOptions options = {});

}  // namespace turnstile::cli
