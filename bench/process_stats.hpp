// SPDX-License-Identifier: Apache-2.0
// What the growth and async benchmarks read about their own process (/proc/self), and the one
// JSON string spelling of their output.
#pragma once

#include <sys/resource.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

inline long rss_kib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atol(line.c_str() + 6);
  }
  return 0;
}

// The entries of a /proc directory (threads: /proc/self/task, descriptors: /proc/self/fd); -1
// when it cannot be opened (for /proc/self/fd: every descriptor in use).
inline long proc_entries(const char* directory) {
  long n = 0;
  std::error_code error;
  for (std::filesystem::directory_iterator it(directory, error), end; !error && it != end; it.increment(error)) ++n;
  return error ? -1 : n;
}

// 10,000 file:// names held at once take 2 descriptors each: more than a common hard limit of
// 20,000. Root (CAP_SYS_RESOURCE, as in CI) may raise the hard limit too; others get theirs.
inline void raise_descriptor_limit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  constexpr rlim_t kWanted = 65'536;
  if (limit.rlim_max != RLIM_INFINITY && limit.rlim_max < kWanted) {
    const rlimit raised{kWanted, kWanted};
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) return;
  }
  limit.rlim_cur = limit.rlim_max;
  setrlimit(RLIMIT_NOFILE, &limit);
}

inline std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    out += (c == '\n' || c == '\t') ? ' ' : c;
  }
  return out + "\"";
}
