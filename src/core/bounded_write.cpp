// SPDX-License-Identifier: Apache-2.0
#include "core/bounded_write.hpp"

#include <poll.h>
#include <unistd.h>

#include <cerrno>

namespace turnstile::detail {

bool write_within(int fd, std::string_view bytes, std::chrono::milliseconds patience) noexcept {
  std::size_t written = 0;
  while (written < bytes.size()) {
    pollfd ready{.fd = fd, .events = POLLOUT, .revents = 0};
    if (::poll(&ready, 1, static_cast<int>(patience.count())) != 1 || !(ready.revents & POLLOUT)) return false;
    const auto n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) return false;
    written += static_cast<std::size_t>(n);
  }
  return true;
}

}  // namespace turnstile::detail
