// SPDX-License-Identifier: Apache-2.0
// Compiled into each test program with that program's TURNSTILE_CONFORMANCE_SERVERS (the
// servers its CTest fixtures start); the rest of the suite's support is one library.
#include <cctype>
#include <cstdlib>
#include <string>
#include <vector>

#include "conformance/backend_param.hpp"

namespace conformance {

std::vector<BackendParam> backend_params() {
  std::vector<BackendParam> params{{"file", ""}};
  // Servers the build knows how to start (TURNSTILE_CONFORMANCE_SERVERS="label=@url-file|..."):
  // their CTest fixture writes the URL into the file before the tests run.
#ifdef TURNSTILE_CONFORMANCE_SERVERS
  {
    std::string list = TURNSTILE_CONFORMANCE_SERVERS;
    std::size_t start = 0;
    while (start < list.size()) {
      auto end = list.find('|', start);
      if (end == std::string::npos) end = list.size();
      const auto item = list.substr(start, end - start);
      if (const auto eq = item.find('='); eq != std::string::npos)
        params.push_back({item.substr(0, eq), item.substr(eq + 1)});
      start = end + 1;
    }
  }
#endif
  const char* extra = std::getenv("TURNSTILE_CONFORMANCE_URLS");
  if (!extra) return params;
  std::string list(extra);
  std::size_t start = 0;
  while (start <= list.size()) {
    auto end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    std::string url = list.substr(start, end - start);
    while (!url.empty() && std::isspace(static_cast<unsigned char>(url.front()))) url.erase(url.begin());
    while (!url.empty() && std::isspace(static_cast<unsigned char>(url.back()))) url.pop_back();
    if (!url.empty()) {
      std::string label;
      for (unsigned char c : url) label += std::isalnum(c) ? static_cast<char>(c) : '_';
      label += "_" + std::to_string(params.size());
      params.push_back({label, url});
    }
    start = end + 1;
  }
  return params;
}

}  // namespace conformance
