// SPDX-License-Identifier: Apache-2.0
// Close-on-exec for the descriptors libzookeeper_mt opens itself. Debian's build does not
// enable the client's SOCK_CLOEXEC option, and setting FD_CLOEXEC afterwards would race with a
// fork+exec in another thread. The archive is linked into our module with
// --wrap=socket,pipe,open (see CMakeLists.txt): its calls land here, and only its calls (the
// linker rewrites the references of the objects it links, not libc or anyone else's).
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdarg>

extern "C" {
int __real_socket(int domain, int type, int protocol);
int __real_open(const char* path, int flags, ...);

__attribute__((visibility("hidden"))) int __wrap_socket(int domain, int type, int protocol) {
  return __real_socket(domain, type | SOCK_CLOEXEC, protocol);
}

__attribute__((visibility("hidden"))) int __wrap_pipe(int fds[2]) { return pipe2(fds, O_CLOEXEC); }

__attribute__((visibility("hidden"))) int __wrap_open(const char* path, int flags, ...) {
  mode_t mode = 0;
  if (flags & (O_CREAT | O_TMPFILE)) {
    va_list args;
    va_start(args, flags);
    mode = static_cast<mode_t>(va_arg(args, int));
    va_end(args);
  }
  return __real_open(path, flags | O_CLOEXEC, mode);
}
}
