#include "support/tcp_proxy.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <list>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace turnstile_test {
namespace {

constexpr std::size_t buffer_limit = 64 * 1024;
constexpr std::size_t connection_limit = 256;

[[noreturn]] void fail(const std::string& what) {
  throw std::runtime_error("TcpProxy: " + what + ": " + std::strerror(errno));
}

// Closes with a reset rather than a FIN: what a crashed or reset link looks like to the peer.
void close_with_reset(int fd) {
  if (fd < 0) return;
  linger option{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &option, sizeof option);
  ::close(fd);
}

// Bytes read from one side, waiting to be written to the other.
struct Buffer {
  std::vector<char> bytes;
  std::size_t space() const { return bytes.size() < buffer_limit ? buffer_limit - bytes.size() : 0; }
  bool empty() const { return bytes.empty(); }
};

struct Connection {
  int client = -1;
  int server = -1;
  bool connect_started = false;  // connected onwards once only: a side lost is not replaced
  bool connecting = false;
  bool client_eof = false;  // the client sent FIN
  bool server_eof = false;
  bool server_shut = false;  // FIN passed on to the server
  bool client_shut = false;
  Buffer up;    // client -> server
  Buffer down;  // server -> client
};

}  // namespace

struct TcpProxy::State {
  sockaddr_storage target{};
  socklen_t target_size = 0;
  int listener = -1;
  int wake = -1;  // eventfd: a mode change, a reset or shutdown
  std::uint16_t port = 0;

  mutable std::mutex mutex;
  std::condition_variable seen;
  Mode mode = Mode::forward;
  bool drop_next = false;
  std::uint64_t drop_serial = 0;  // bumped by every drop_next_reply()
  bool pass_one = false;          // hold_replies: let one chunk of replies through
  bool stop = false;
  std::uint64_t requested = 0;  // bumped by every request to the thread
  std::uint64_t observed = 0;   // the last request the thread has acted on
  std::uint64_t reset_requested = 0;
  std::uint64_t resets_done = 0;  // the thread's own
  bool stopped = false;

  std::atomic<std::size_t> open{0};
  std::atomic<std::uint64_t> accepted{0};
  std::atomic<std::uint64_t> dropped{0};
  std::atomic<std::chrono::steady_clock::rep> last_request{0};  // steady_clock ticks
  std::list<Connection> connections;  // the thread's own
  std::thread thread;

  // Asks the thread to act on the current settings and waits until it has.
  void request(std::unique_lock<std::mutex>& lock) {
    const auto mine = ++requested;
    const std::uint64_t one = 1;
    if (::write(wake, &one, sizeof one) < 0 && errno != EAGAIN) {
      // eventfd writes cannot fail short of overflow; the wait below would then hang.
      throw std::runtime_error("TcpProxy: cannot wake its thread");
    }
    seen.wait(lock, [&] { return observed >= mine || stopped; });
  }

  void start_connect(Connection& c) {
    c.connect_started = true;
    c.server = ::socket(target.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (c.server < 0) return;
    const int one = 1;
    ::setsockopt(c.server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (::connect(c.server, reinterpret_cast<const sockaddr*>(&target), target_size) == 0) return;
    if (errno == EINPROGRESS) {
      c.connecting = true;
      return;
    }
    ::close(c.server);
    c.server = -1;
    close_with_reset(c.client);
    c.client = -1;
  }

  static void kill(Connection& c) {
    close_with_reset(c.client);
    close_with_reset(c.server);
    c.client = c.server = -1;
  }

  // Reads what `from` has into `into` (bounded); false on EOF (sets eof) or a hard error.
  static bool read_into(int from, Buffer& into, bool& eof) {
    if (into.space() == 0) return true;
    char chunk[buffer_limit];
    const auto n = ::read(from, chunk, into.space());
    if (n > 0) {
      into.bytes.insert(into.bytes.end(), chunk, chunk + n);
      return true;
    }
    if (n == 0) {
      eof = true;
      return true;
    }
    return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  }

  static bool write_from(int to, Buffer& from) {
    const auto n = ::send(to, from.bytes.data(), from.bytes.size(), MSG_NOSIGNAL);
    if (n >= 0) {
      from.bytes.erase(from.bytes.begin(), from.bytes.begin() + n);
      return true;
    }
    return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  }

  void accept_all() {
    for (;;) {
      const int fd = ::accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;
      accepted.fetch_add(1);
      if (connections.size() >= connection_limit) {
        close_with_reset(fd);
        continue;
      }
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      connections.emplace_back().client = fd;
    }
  }

  // What to poll a connection's sockets for.
  static short client_events(const Connection& c, bool forwarding) {
    if (!forwarding || c.client < 0) return 0;
    short events = 0;
    if (!c.client_eof && c.up.space() > 0) events |= POLLIN;
    if (!c.down.empty()) events |= POLLOUT;
    return events;
  }
  static short server_events(const Connection& c, bool forwarding, bool reading) {
    if (!forwarding || c.server < 0) return 0;
    if (c.connecting) return POLLOUT;
    short events = 0;
    if (reading && !c.server_eof && c.down.space() > 0) events |= POLLIN;
    if (!c.up.empty()) events |= POLLOUT;
    return events;
  }

  // Handles one connection's poll results; false when it is finished.
  bool serve(Connection& c, short client_revents, short server_revents, Mode current, bool& drop_once, bool& pass) {
    const bool forwarding = current != Mode::blackhole;
    if (!forwarding) {
      // A cut link: a side that closed or failed is closed on our side only; the other side
      // learns nothing until forwarding resumes.
      if (c.client >= 0 && (client_revents & (POLLERR | POLLHUP | POLLNVAL))) {
        ::close(c.client);
        c.client = -1;
      }
      if (c.server >= 0 && (server_revents & (POLLERR | POLLHUP | POLLNVAL))) {
        ::close(c.server);
        c.server = -1;
      }
      return c.client >= 0 || c.server >= 0;
    }
    if (c.client < 0 || c.server < 0) {
      // One side went away while the link was cut (or the onward connect failed).
      kill(c);
      return false;
    }
    if ((client_revents & (POLLERR | POLLNVAL)) || (server_revents & (POLLERR | POLLNVAL))) {
      kill(c);
      return false;
    }
    if (c.connecting && (server_revents & (POLLOUT | POLLHUP))) {
      int error = 0;
      socklen_t size = sizeof error;
      ::getsockopt(c.server, SOL_SOCKET, SO_ERROR, &error, &size);
      if (error != 0) {
        kill(c);
        return false;
      }
      c.connecting = false;
      server_revents = 0;  // write on the next round
    }
    if ((client_revents & (POLLIN | POLLHUP)) && !c.client_eof) {
      const auto before = c.up.bytes.size();
      if (!read_into(c.client, c.up, c.client_eof)) {
        kill(c);
        return false;
      }
      if (c.up.bytes.size() != before) last_request.store(std::chrono::steady_clock::now().time_since_epoch().count());
    }
    // Held replies stay in the kernel's buffers until passed (or dropped); a closed server
    // side is still read, so its hang-up cannot spin the loop.
    const bool holding = current == Mode::hold_replies && !pass && !(server_revents & (POLLHUP | POLLERR));
    if (!c.connecting && !holding && (server_revents & (POLLIN | POLLHUP)) && !c.server_eof) {
      const auto before = c.down.bytes.size();
      const bool dropping = current == Mode::drop_replies || drop_once;
      Buffer scratch;
      Buffer& into = dropping ? scratch : c.down;
      if (!read_into(c.server, into, c.server_eof)) {
        kill(c);
        return false;
      }
      if (dropping && !scratch.empty()) {
        dropped.fetch_add(scratch.bytes.size());
        drop_once = false;
      }
      if (current == Mode::hold_replies && c.down.bytes.size() != before) pass = false;
    }
    if (!c.connecting && c.server >= 0 && !c.up.empty() && !write_from(c.server, c.up)) {
      kill(c);
      return false;
    }
    if (!c.down.empty() && !write_from(c.client, c.down)) {
      kill(c);
      return false;
    }
    // Pass half-closes on once everything before them was delivered.
    if (c.client_eof && c.up.empty() && !c.server_shut && c.server >= 0 && !c.connecting) {
      ::shutdown(c.server, SHUT_WR);
      c.server_shut = true;
    }
    if (c.server_eof && c.down.empty() && !c.client_shut) {
      ::shutdown(c.client, SHUT_WR);
      c.client_shut = true;
    }
    if (c.server_shut && c.client_shut) {
      ::close(c.client);
      if (c.server >= 0) ::close(c.server);
      c.client = c.server = -1;
      return false;
    }
    return true;
  }

  void run() {
    std::vector<pollfd> fds;
    for (;;) {
      Mode current;
      bool drop_once;
      bool pass;
      std::uint64_t serial;
      std::uint64_t resets;
      {
        std::lock_guard lock(mutex);
        if (stop) break;
        current = mode;
        drop_once = drop_next;
        pass = pass_one;
        serial = drop_serial;
        resets = reset_requested;
      }
      if (resets != resets_done) {
        for (auto& c : connections) kill(c);
        connections.clear();
        resets_done = resets;
      }
      const bool forwarding = current != Mode::blackhole;
      if (forwarding) {
        for (auto it = connections.begin(); it != connections.end();) {
          if (!it->connect_started && it->client >= 0) start_connect(*it);
          it = (it->client < 0 && it->server < 0) ? connections.erase(it) : std::next(it);
        }
      }
      {
        // Everything requested so far is now in force.
        std::lock_guard lock(mutex);
        observed = requested;
      }
      seen.notify_all();
      open.store(connections.size());

      fds.clear();
      fds.push_back({wake, POLLIN, 0});
      fds.push_back({listener, POLLIN, 0});
      for (const auto& c : connections) {
        fds.push_back({c.client, client_events(c, forwarding), 0});
        fds.push_back({c.server, server_events(c, forwarding, current != Mode::hold_replies || pass), 0});
      }
      if (::poll(fds.data(), fds.size(), -1) < 0) {
        if (errno == EINTR) continue;
        break;
      }
      if (fds[0].revents & POLLIN) {
        std::uint64_t count;
        (void)!::read(wake, &count, sizeof count);
      }
      const bool pass_requested = pass;
      std::size_t index = 2;
      for (auto it = connections.begin(); it != connections.end(); index += 2) {
        const bool keep = serve(*it, fds[index].revents, fds[index + 1].revents, current, drop_once, pass);
        it = keep ? std::next(it) : connections.erase(it);
      }
      if (!drop_once) {
        // Consumed; unless a newer drop_next_reply() came meanwhile.
        std::lock_guard lock(mutex);
        if (drop_serial == serial) drop_next = false;
      }
      if (pass_requested && !pass) {
        {
          std::lock_guard lock(mutex);
          pass_one = false;
        }
        seen.notify_all();
      }
      if (fds[1].revents & POLLIN) accept_all();
    }
    for (auto& c : connections) kill(c);
    connections.clear();
    open.store(0);
    {
      std::lock_guard lock(mutex);
      stopped = true;
    }
    seen.notify_all();
  }
};

namespace {

std::uint16_t default_port(const std::string& scheme) {
  if (scheme == "redis" || scheme == "rediss") return 6379;
  if (scheme == "zookeeper" || scheme == "zk") return 2181;
  if (scheme == "etcd" || scheme == "etcds") return 2379;
  throw std::invalid_argument("TcpProxy: no default port for scheme '" + scheme + "'");
}

// The positions of a URL's host list: [begin, end) after "scheme://" and any user info.
std::pair<std::size_t, std::size_t> host_list_span(const std::string& url) {
  const auto scheme_end = url.find("://");
  if (scheme_end == std::string::npos) throw std::invalid_argument("TcpProxy: not a URL: no scheme");
  const auto begin = scheme_end + 3;
  const auto end = std::min(url.find('/', begin), url.find('?', begin));
  const auto authority_end = end == std::string::npos ? url.size() : end;
  const auto at = url.rfind('@', authority_end == 0 ? 0 : authority_end - 1);
  const auto hosts_begin = (at != std::string::npos && at >= begin) ? at + 1 : begin;
  return {hosts_begin, authority_end};
}

}  // namespace

std::pair<std::string, std::uint16_t> TcpProxy::endpoint_of(const std::string& backend_url) {
  const auto [begin, end] = host_list_span(backend_url);
  auto first = backend_url.substr(begin, end - begin);
  first = first.substr(0, first.find(','));
  const auto scheme = backend_url.substr(0, backend_url.find("://"));
  std::string host = first;
  std::string port;
  if (!first.empty() && first.front() == '[') {
    const auto close = first.find(']');
    if (close == std::string::npos) throw std::invalid_argument("TcpProxy: bad IPv6 host");
    host = first.substr(1, close - 1);
    if (close + 1 < first.size() && first[close + 1] == ':') port = first.substr(close + 2);
  } else if (const auto colon = first.rfind(':'); colon != std::string::npos) {
    host = first.substr(0, colon);
    port = first.substr(colon + 1);
  }
  if (host.empty()) throw std::invalid_argument("TcpProxy: the URL has no host");
  return {host, port.empty() ? default_port(scheme) : static_cast<std::uint16_t>(std::stoi(port))};
}

TcpProxy::TcpProxy(const std::string& backend_url)
    : TcpProxy(endpoint_of(backend_url).first, endpoint_of(backend_url).second) {}

TcpProxy::TcpProxy(const std::string& host, std::uint16_t port) : state_(std::make_unique<State>()) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || !found) {
    throw std::runtime_error("TcpProxy: cannot resolve " + host);
  }
  std::memcpy(&state_->target, found->ai_addr, found->ai_addrlen);
  state_->target_size = found->ai_addrlen;
  ::freeaddrinfo(found);

  state_->listener = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (state_->listener < 0) fail("socket");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  if (::bind(state_->listener, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) fail("bind");
  if (::listen(state_->listener, 64) != 0) fail("listen");
  socklen_t size = sizeof address;
  ::getsockname(state_->listener, reinterpret_cast<sockaddr*>(&address), &size);
  state_->port = ntohs(address.sin_port);
  state_->wake = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (state_->wake < 0) fail("eventfd");
  state_->thread = std::thread([state = state_.get()] { state->run(); });
}

TcpProxy::~TcpProxy() { shutdown(); }

void TcpProxy::shutdown() {
  {
    std::unique_lock lock(state_->mutex);
    if (state_->stop) return;
    state_->stop = true;
    state_->request(lock);
  }
  state_->thread.join();
  ::close(state_->listener);
  ::close(state_->wake);
}

std::uint16_t TcpProxy::port() const { return state_->port; }

std::string TcpProxy::url_through(const std::string& backend_url) const {
  const auto [begin, end] = host_list_span(backend_url);
  return backend_url.substr(0, begin) + "127.0.0.1:" + std::to_string(state_->port) + backend_url.substr(end);
}

void TcpProxy::set_mode(Mode mode) {
  std::unique_lock lock(state_->mutex);
  state_->mode = mode;
  state_->drop_next = false;
  state_->pass_one = false;
  state_->request(lock);
}

TcpProxy::Mode TcpProxy::mode() const {
  std::lock_guard lock(state_->mutex);
  return state_->mode;
}

bool TcpProxy::pass_one_reply(std::chrono::milliseconds wait) {
  std::unique_lock lock(state_->mutex);
  if (state_->mode != Mode::hold_replies) return false;
  state_->pass_one = true;
  state_->request(lock);
  if (state_->seen.wait_for(lock, wait, [&] { return !state_->pass_one || state_->stopped; })) return !state_->stopped;
  state_->pass_one = false;
  return false;
}

void TcpProxy::drop_next_reply() {
  std::unique_lock lock(state_->mutex);
  state_->mode = Mode::forward;
  state_->drop_next = true;
  ++state_->drop_serial;
  state_->request(lock);
}

std::chrono::steady_clock::time_point TcpProxy::last_request_at() const {
  return std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(state_->last_request.load()));
}

std::chrono::steady_clock::time_point TcpProxy::blackhole_when_quiet(std::chrono::milliseconds quiet,
                                                                     std::chrono::milliseconds timeout) {
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < give_up) {
    const auto since = std::chrono::steady_clock::now() - last_request_at();
    if (since < quiet) {
      std::this_thread::sleep_for(quiet - since);
      continue;
    }
    const auto cut = std::chrono::steady_clock::now();
    blackhole();
    // Bytes read between the look above and the cut took effect: try again at the next lull.
    if (last_request_at() <= cut - quiet) return cut;  // nothing is read once black-holed
    forward();
  }
  throw std::runtime_error("TcpProxy: no quiet moment to cut the link");
}

void TcpProxy::reset() {
  std::unique_lock lock(state_->mutex);
  ++state_->reset_requested;
  state_->request(lock);
}

std::size_t TcpProxy::open_connections() const { return state_->open.load(); }
std::uint64_t TcpProxy::accepted() const { return state_->accepted.load(); }
std::uint64_t TcpProxy::dropped_bytes() const { return state_->dropped.load(); }

}  // namespace turnstile_test
