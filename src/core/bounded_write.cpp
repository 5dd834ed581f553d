// SPDX-License-Identifier: Apache-2.0
#include "core/bounded_write.hpp"

#include <limits.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace turnstile::detail {
namespace {

// Writes what `fd` takes now, without waiting: poll() said it has room, but a blocking write
// may still wait for more room than it has. A socket (stderr under systemd is journald's) is
// sent to without waiting; anything else gets at most PIPE_BUF bytes, which a pipe with room
// takes whole.
ssize_t write_some(int fd, const char* bytes, std::size_t size) noexcept {
  const auto sent = ::send(fd, bytes, size, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (sent >= 0 || errno != ENOTSOCK) return sent;
  return ::write(fd, bytes, std::min<std::size_t>(size, PIPE_BUF));
}

}  // namespace

std::size_t write_within(int fd, std::string_view bytes, std::chrono::milliseconds patience) noexcept {
  // One deadline for the whole: a reader that takes a byte now and then cannot stretch it.
  const auto give_up = std::chrono::steady_clock::now() + patience;
  std::size_t written = 0;
  while (written < bytes.size()) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(give_up - std::chrono::steady_clock::now());
    pollfd ready{.fd = fd, .events = POLLOUT, .revents = 0};
    const int wait_ms = static_cast<int>(std::max<std::chrono::milliseconds::rep>(left.count(), 0));
    if (::poll(&ready, 1, wait_ms) != 1 || !(ready.revents & POLLOUT)) return written;
    const auto n = write_some(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) return written;
    written += static_cast<std::size_t>(n);
  }
  return written;
}

}  // namespace turnstile::detail
