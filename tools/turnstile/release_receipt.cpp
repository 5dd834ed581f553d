// SPDX-License-Identifier: Apache-2.0
// `turnstile __release-receipt` (hidden): what the group watcher executes once turnstile died
// without releasing (SIGKILL). It reads "<backend URL line>\n<receipt>\n" from stdin (a pipe the
// watcher filled before turnstile could die: never argv or the environment, which others can
// read, since the URL may carry credentials), connects and removes exactly that entry.
// Best effort and bounded: the server's TTL remains the fallback.
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <optional>
#include <string>

#include "commands.hpp"
#include "common.hpp"

namespace turnstile::cli {

namespace {

// Reads stdin to its end (the watcher's payload is far smaller).
std::string read_order() {
  std::string text;
  char buffer[4096];
  for (;;) {
    const ssize_t n = read(STDIN_FILENO, buffer, sizeof buffer);
    if (n > 0 && text.size() < kMaxReleaseOrder) text.append(buffer, static_cast<std::size_t>(n));
    if (n == 0 || (n < 0 && errno != EINTR)) return text;
  }
}

}  // namespace

std::string release_order(const std::optional<std::string>& backend, const std::string& receipt) {
  return (backend ? "url " + *backend : std::string("default")) + "\n" + receipt + "\n";
}

int release_receipt_command() {
  // The watcher blocked every signal; here SIGALRM must end a release that outlasts its bound.
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  alarm(kReleaseByReceiptGiveUp);
  const auto order = read_order();
  const auto first_end = order.find('\n');
  const auto second_end = first_end == std::string::npos ? first_end : order.find('\n', first_end + 1);
  if (second_end == std::string::npos) return kExitUsage;
  const auto backend_line = order.substr(0, first_end);
  const auto receipt = order.substr(first_end + 1, second_end - first_end - 1);
  std::optional<std::string> backend;
  if (backend_line.starts_with("url ")) {
    backend = backend_line.substr(4);
  } else if (backend_line != "default") {
    return kExitUsage;
  }
  try {
    ClientOptions options;
    options.connect_timeout = kReleaseByReceiptConnect;
    options.error_handler = [](const Error&) {};  // nobody reads it: stderr is /dev/null
    auto client = connect_backend(backend, options);
    client.release_receipt(receipt, std::chrono::steady_clock::now() + kReleaseByReceiptTries);
    return 0;
  } catch (const std::exception&) {
    return kExitUnavailable;
  }
}

}  // namespace turnstile::cli
