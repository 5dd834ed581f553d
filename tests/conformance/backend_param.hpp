// SPDX-License-Identifier: Apache-2.0
// One backend a parameterised suite runs against, and the list of them this test program was
// built for. Kept apart from support.hpp (which includes gtest and turnstile) so that
// backend_params.cpp, compiled into every test program with that program's own
// TURNSTILE_CONFORMANCE_SERVERS, stays a few lines; support.cpp is compiled once, into the
// turnstile_conformance_support library.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace conformance {

// An empty url means "a fresh file:// directory per test"; "@path" means "the URL written in
// that file" (by the CTest fixture that starts the server).
struct BackendParam {
  std::string label;
  std::string url;
};

// How gtest shows the parameter (in test names listed by CTest, too).
inline void PrintTo(const BackendParam& param, std::ostream* out) {
  *out << (param.url.empty() ? std::string("fresh file:// directory") : param.url);
}

// The embedded backend, the servers this program was built for, then every URL of
// TURNSTILE_CONFORMANCE_URLS (comma-separated).
std::vector<BackendParam> backend_params();

}  // namespace conformance
