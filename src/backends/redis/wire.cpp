// SPDX-License-Identifier: Apache-2.0
#include "backends/redis/wire.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstring>

namespace turnstile::detail::redis {

using std::chrono::milliseconds;

namespace {
// hiredis 0.14 builds replies of any size the server announces (an array header allocates its
// element table at once). These wrap its default builders and refuse a reply that would take
// more than kMaxReplyBytes; the reader then fails and the connection is dropped.
struct ReplyBudget {
  std::size_t used = 0;
  bool exceeded = false;
};

const redisReplyObjectFunctions* default_functions() {
  static const redisReplyObjectFunctions* const functions = [] {
    redisReader* reader = redisReaderCreate();
    const auto* found = reader ? reader->fn : nullptr;  // hiredis' static default table
    if (reader) redisReaderFree(reader);
    return found;
  }();
  return functions;
}

bool charge(const redisReadTask* task, std::size_t bytes) {
  auto* budget = static_cast<ReplyBudget*>(task->privdata);
  if (!budget) return true;
  if (bytes > kMaxReplyBytes || budget->used > kMaxReplyBytes - bytes) {
    budget->exceeded = true;
    return false;
  }
  budget->used += bytes;
  return true;
}

void* bounded_string(const redisReadTask* task, char* text, size_t length) {
  if (!charge(task, sizeof(redisReply) + length)) return nullptr;
  return default_functions()->createString(task, text, length);
}
void* bounded_array(const redisReadTask* task, int elements) {
  if (elements < 0 || !charge(task, sizeof(redisReply) + static_cast<std::size_t>(elements) * sizeof(redisReply*))) {
    return nullptr;
  }
  return default_functions()->createArray(task, elements);
}
void* bounded_integer(const redisReadTask* task, long long value) {
  if (!charge(task, sizeof(redisReply))) return nullptr;
  return default_functions()->createInteger(task, value);
}
void* bounded_nil(const redisReadTask* task) {
  if (!charge(task, sizeof(redisReply))) return nullptr;
  return default_functions()->createNil(task);
}

redisReplyObjectFunctions bounded_functions{bounded_string, bounded_array, bounded_integer, bounded_nil,
                                            freeReplyObject};

ReplyBudget* budget_of(redisContext* context) {
  return context->reader && context->reader->fn == &bounded_functions
             ? static_cast<ReplyBudget*>(context->reader->privdata)
             : nullptr;
}

void set_error(redisContext* context, int code, const std::string& text) {
  context->err = code;
  std::snprintf(context->errstr, sizeof context->errstr, "%s", text.c_str());
}

std::string too_large() { return "a reply larger than " + std::to_string(kMaxReplyBytes >> 20) + " MiB (refused)"; }

}  // namespace

void bound_replies(redisContext* context) {
  if (!default_functions()) return;  // cannot happen with hiredis 0.14; unbounded rather than broken
  context->reader->fn = &bounded_functions;
  context->reader->privdata = new ReplyBudget;
}

// Waits until `fd` has one of `events` (or an error/hangup), by `until`. False, with `why`, on
// timeout or when `cancel_fd` became readable.
bool wait_for(int fd, short events, SteadyClock::time_point until, int cancel_fd, std::string& why) {
  for (;;) {
    pollfd fds[2] = {{fd, events, 0}, {cancel_fd, POLLIN, 0}};
    const int timeout = poll_timeout(until);
    const int ready = poll(fds, cancel_fd >= 0 ? 2 : 1, timeout);
    if (ready < 0) {
      if (errno == EINTR) continue;
      why = std::string("poll failed: ") + std::strerror(errno);
      return false;
    }
    if (cancel_fd >= 0 && fds[1].revents) {
      why = "cancelled";
      return false;
    }
    if (fds[0].revents) return true;
    if (timeout == 0 || SteadyClock::now() >= until) {
      why = kNoAnswerInTime;
      return false;
    }
  }
}

// A non-blocking, close-on-exec TCP connection to host:port, made by `until`.
int connect_socket(const Settings& settings, SteadyClock::time_point until, int cancel_fd) {
  const auto fail = [&](const std::string& why) -> BackendUnavailable {
    return BackendUnavailable("cannot connect to redis at " + settings.description + ": " + why);
  };
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const auto port = std::to_string(settings.port);
  if (const int error = getaddrinfo(settings.host.c_str(), port.c_str(), &hints, &found); error != 0) {
    throw fail(gai_strerror(error));
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> addresses(found, freeaddrinfo);
  std::string why = "no address";
  for (const auto* address = found; address; address = address->ai_next) {
    // Close-on-exec from the start: no window in which a fork+exec elsewhere inherits it.
    const int fd =
        socket(address->ai_family, address->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, address->ai_protocol);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    int error = 0;
    if (connect(fd, address->ai_addr, address->ai_addrlen) != 0) {
      error = errno;
      if (error == EINPROGRESS) {
        if (!wait_for(fd, POLLOUT, until, cancel_fd, why)) {
          close(fd);
          if (why == "cancelled") throw fail(why);
          why = "no answer within the connect timeout";
          continue;
        }
        socklen_t length = sizeof error;
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) != 0) error = errno;
      }
    }
    if (error != 0) {
      why = std::strerror(error);
      close(fd);
      continue;
    }
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
  }
  throw fail(why);
}

int poll_timeout(SteadyClock::time_point until) {
  if (until == SteadyClock::time_point::max()) return -1;
  const auto left = std::chrono::ceil<milliseconds>(until - SteadyClock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, INT_MAX));
}

void ContextDeleter::operator()(redisContext* context) const {
  auto* budget = budget_of(context);
  redisFree(context);
  delete budget;
}

StopFd::StopFd(std::stop_token stop) {
  if (!stop.stop_possible()) return;
  fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (fd_ < 0) throw BackendUnavailable(std::string("eventfd failed: ") + std::strerror(errno));
  callback_.emplace(std::move(stop), Signal{fd_});  // runs at once when already requested
}

StopFd::~StopFd() {
  callback_.reset();  // waits for a callback running on another thread
  if (fd_ >= 0) close(fd_);
}

void StopFd::Signal::operator()() const noexcept {
  const std::uint64_t one = 1;
  [[maybe_unused]] auto written = write(fd, &one, sizeof one);
}

Wait::Wait(Deadline deadline, std::stop_token stop_token, int cancel)
    : start(SteadyClock::now()), try_once(deadline && *deadline <= start),
      until(!deadline  ? SteadyClock::time_point::max()
            : try_once ? start + kReplyTimeout
                       : *deadline),
      stop(std::move(stop_token)), cancel_fd(cancel) {}

SteadyClock::time_point Wait::connect_until() const { return std::min(until, SteadyClock::now() + kConnectTimeout); }
SteadyClock::time_point Wait::reply_until() const { return std::min(until, SteadyClock::now() + kReplyTimeout); }

bool append_command(std::string& out, const Command& command) {
  std::vector<const char*> argv;
  std::vector<size_t> lengths;
  for (const auto& arg : command) {
    argv.push_back(arg.data());
    lengths.push_back(arg.size());
  }
  char* formatted = nullptr;
  const int length = redisFormatCommandArgv(&formatted, static_cast<int>(argv.size()), argv.data(), lengths.data());
  if (length < 0 || !formatted) return false;
  out.append(formatted, static_cast<std::size_t>(length));
  redisFreeCommand(formatted);
  return true;
}

bool write_pending(redisContext* context, std::string& out) {
  // Our own send(): hiredis' write() raises SIGPIPE on a connection the peer closed, which
  // would kill the process (turnstile leaves signal dispositions to the application).
  if (out.empty()) return true;
  const auto written = send(context->fd, out.data(), out.size(), MSG_NOSIGNAL);
  if (written < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return true;
    set_error(context, REDIS_ERR_IO, std::strerror(errno));
    return false;
  }
  out.erase(0, static_cast<std::size_t>(written));
  return true;
}

bool read_available(redisContext* context) {
  const auto* reader = context->reader;
  if (reader->len - reader->pos > kMaxReplyBytes) {
    set_error(context, REDIS_ERR_OTHER, too_large());
    return false;
  }
  return redisBufferRead(context) == REDIS_OK;
}

bool next_reply(redisContext* context, Reply& reply) {
  void* raw = nullptr;
  if (redisGetReplyFromReader(context, &raw) != REDIS_OK) {
    if (auto* budget = budget_of(context); budget && budget->exceeded) set_error(context, REDIS_ERR_OTHER, too_large());
    return false;
  }
  reply.reset(static_cast<redisReply*>(raw));
  if (raw) {
    if (auto* budget = budget_of(context)) budget->used = 0;  // the next reply starts afresh
  }
  return true;
}

std::string read_replies(redisContext* context, std::size_t count, std::vector<Reply>& replies,
                         SteadyClock::time_point until, int cancel_fd) {
  std::string why;
  replies.clear();
  while (replies.size() < count) {
    Reply reply;
    if (!next_reply(context, reply)) return context->errstr;
    if (reply) {
      replies.push_back(std::move(reply));
      continue;
    }
    if (!wait_for(context->fd, POLLIN, until, cancel_fd, why)) return why;
    if (!read_available(context)) return context->errstr;
  }
  return "";
}

std::string write_all(redisContext* context, std::string& out, SteadyClock::time_point until, int cancel_fd,
                      bool* sent) {
  // Written at once as a rule (an idle socket's buffer takes a request): poll() only when the
  // socket took less than all of it.
  std::string why;
  for (bool first = true; !out.empty(); first = false) {
    if (!first && !wait_for(context->fd, POLLOUT, until, cancel_fd, why)) return why;
    const auto before = out.size();
    if (!write_pending(context, out)) return context->errstr;
    if (sent && out.size() < before) *sent = true;
  }
  return "";
}

std::string exchange(redisContext* context, const std::vector<Command>& commands, std::vector<Reply>& replies,
                     SteadyClock::time_point until, int cancel_fd, bool* sent, Earlier earlier) {
  if (sent) *sent = false;
  std::string out;
  for (const auto& command : commands) {
    if (!append_command(out, command)) return "out of memory";
  }
  if (auto failed = write_all(context, out, until, cancel_fd, sent); !failed.empty()) return failed;
  // The replies to commands sent before ours come first: the server answers in order.
  if (earlier.count > 0) {
    if (auto failed = read_replies(context, earlier.count, *earlier.replies, until, cancel_fd); !failed.empty()) {
      return failed;
    }
  }
  return read_replies(context, commands.size(), replies, until, cancel_fd);
}
}  // namespace turnstile::detail::redis
