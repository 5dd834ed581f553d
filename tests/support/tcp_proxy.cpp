// SPDX-License-Identifier: Apache-2.0
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
#include <optional>
#include <stdexcept>
#include <thread>
#include <vector>

#include "support/proxy_connection.hpp"

namespace turnstile_test {

using namespace detail;

namespace {

constexpr std::size_t connection_limit = 256;

[[noreturn]] void fail(const std::string& what) {
  throw std::runtime_error("TcpProxy: " + what + ": " + std::strerror(errno));
}

}  // namespace

struct TcpProxy::State {
  sockaddr_storage target{};
  socklen_t target_size = 0;
  int listener = -1;
  std::uint16_t port = 0;

  // Shared with the held and copied requests handed out; its eventfd wakes the thread for a
  // mode change, a reset, a late request or shutdown.
  std::shared_ptr<detail::ProxyControl> control = std::make_shared<detail::ProxyControl>();
  std::mutex& mutex = control->mutex;
  std::condition_variable& seen = control->seen;
  Mode mode = Mode::forward;
  bool drop_next = false;
  std::uint64_t drop_serial = 0;  // bumped by every drop_next_reply()
  bool pass_one = false;          // hold_replies: let one chunk of replies through
  bool stop = false;
  std::uint64_t reset_requested = 0;
  std::uint64_t resets_done = 0;  // the thread's own

  std::atomic<std::size_t> open{0};
  std::atomic<std::uint64_t> accepted{0};
  std::atomic<std::uint64_t> dropped{0};
  std::atomic<std::chrono::steady_clock::rep> last_request{0};  // steady_clock ticks
  std::list<Connection> connections;                            // the thread's own
  std::uint64_t next_connection = 0;                            // the thread's own
  std::thread thread;

  // Asks the thread to act on the current settings and waits until it has.
  void request(std::unique_lock<std::mutex>& lock) { control->request(lock); }

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
      auto& c = connections.emplace_back();
      c.client = fd;
      c.watch.id = ++next_connection;
    }
  }

  // What to poll a connection's sockets for.
  static short client_events(const Connection& c, bool forwarding) {
    if (!forwarding || c.client < 0) return 0;
    short events = 0;
    if (!c.client_eof && c.up.space() > 0 && c.watch.kept.size() < buffer_limit) events |= POLLIN;
    if (!c.down.empty()) events |= POLLOUT;
    return events;
  }
  static short server_events(const Connection& c, bool forwarding, bool reading) {
    if (!forwarding || c.server < 0) return 0;
    if (c.connecting) return POLLOUT;
    short events = 0;
    if ((reading || c.orphan) && !c.server_eof && c.down.space() > 0) events |= POLLIN;
    if (!c.up.empty()) events |= POLLOUT;
    return events;
  }

  // Reads the client's requests into `up`, or into `kept` from a held chunk on; false on a
  // hard error.
  bool read_requests(Connection& c) {
    const auto room = std::min(c.up.space(), buffer_limit - std::min(buffer_limit, c.watch.kept.size()));
    if (room == 0) return true;
    char chunk[buffer_limit];
    const auto n = ::read(c.client, chunk, room);
    if (n == 0) c.client_eof = true;
    if (n <= 0) return n == 0 || errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    last_request.store(Clock::now().time_since_epoch().count());
    bool keep;
    {
      std::lock_guard lock(mutex);
      keep = control->on_request_chunk(c.watch, std::string_view(chunk, n));
    }
    if (keep && c.watch.kept.empty()) c.watch.first_held = static_cast<std::size_t>(n);
    auto& into = keep ? c.watch.kept : c.up.bytes;
    into.insert(into.end(), chunk, chunk + n);
    return true;
  }

  // Ends an orphan: its server side is closed (a replay not yet written failed).
  bool end_orphan(Connection& c) {
    if (c.watch.replay_of) {
      std::lock_guard lock(mutex);
      ++c.watch.replay_of->replays_failed;
      seen.notify_all();
    }
    if (c.server >= 0) ::close(c.server);
    c.server = -1;
    return false;
  }

  // An orphan: writes what it was given, reads and discards the answers; false when finished.
  bool serve_orphan(Connection& c, short revents) {
    if (c.server < 0 || (revents & (POLLERR | POLLNVAL))) return end_orphan(c);
    if (c.connecting) {
      if (!(revents & (POLLOUT | POLLHUP))) return true;
      if (!connected(c)) return end_orphan(c);
      revents = 0;
    }
    if (revents & (POLLIN | POLLHUP)) {
      Buffer discard;
      bool eof = false;
      if (!read_into(c.server, discard, eof) || eof) return end_orphan(c);
    }
    release_rest_when_due(c);
    if (!c.up.empty() && !write_from(c.server, c.up)) return end_orphan(c);
    if (c.up.empty() && !c.watch.keeps() && !c.close_by) {
      c.close_by = Clock::now() + orphan_linger;
      if (c.watch.replay_of) {
        std::lock_guard lock(mutex);
        ++c.watch.replay_of->replays_written;
        c.watch.replay_of.reset();
        seen.notify_all();
      }
    }
    if (c.close_by && Clock::now() >= *c.close_by) return end_orphan(c);
    return true;
  }

  // Reads the server's replies into `down` (or drops them); false on a hard error.
  bool read_replies(Connection& c, Mode current, bool& drop_once, bool& pass) {
    const auto before = c.down.bytes.size();
    const bool dropping = current == Mode::drop_replies || drop_once;
    Buffer scratch;
    Buffer& into = dropping ? scratch : c.down;
    if (!read_into(c.server, into, c.server_eof)) return false;
    if (dropping && !scratch.empty()) {
      dropped.fetch_add(scratch.bytes.size());
      drop_once = false;
    }
    if (current == Mode::hold_replies && c.down.bytes.size() != before) pass = false;
    if (c.watch.awaiting_reply && (c.down.bytes.size() != before || !scratch.empty())) {
      std::lock_guard lock(mutex);
      control->on_reply(c.watch);
    }
    return true;
  }

  // Handles one connection's poll results; false when it is finished.
  bool serve(Connection& c, short client_revents, short server_revents, Mode current, bool& drop_once, bool& pass) {
    if (current == Mode::blackhole) return serve_cut(c, client_revents, server_revents);
    if (c.orphan) return serve_orphan(c, server_revents);
    // The client went away (while the link was cut, or now), or the onward connect failed.
    if (c.client < 0 || c.server < 0 || (client_revents & (POLLERR | POLLNVAL))) return become_orphan(c);
    if (server_revents & (POLLERR | POLLNVAL)) {
      kill(c);
      return false;
    }
    if (c.connecting && (server_revents & (POLLOUT | POLLHUP))) {
      if (!connected(c)) return false;
      server_revents = 0;  // write on the next round
    }
    if ((client_revents & (POLLIN | POLLHUP)) && !c.client_eof) {
      if (!read_requests(c) || (c.client_eof && c.watch.keeps())) return become_orphan(c);
    }
    // Held replies stay in the kernel's buffers until passed (or dropped); a closed server
    // side is still read, so its hang-up cannot spin the loop.
    const bool holding = current == Mode::hold_replies && !pass && !(server_revents & (POLLHUP | POLLERR));
    if (!c.connecting && !holding && (server_revents & (POLLIN | POLLHUP)) && !c.server_eof &&
        !read_replies(c, current, drop_once, pass)) {
      kill(c);
      return false;
    }
    release_rest_when_due(c);
    if (!c.connecting && c.server >= 0 && !c.up.empty() && !write_from(c.server, c.up)) {
      kill(c);
      return false;
    }
    if (!c.down.empty() && !write_from(c.client, c.down)) return become_orphan(c);
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

  // Acts on what the held and copied requests were asked (mutex held): delivers or drops held
  // connections, and opens a connection for each replay.
  void settle_requests() {
    for (auto& c : connections) {
      auto settle = control->settle(c.watch);
      if (settle == detail::Settle::cut_client) {
        close_with_reset(c.client);
        c.client = -1;
        become_orphan(c);
        settle = control->settle(c.watch);  // a deliver or drop asked meanwhile
      }
      if (settle == detail::Settle::deliver) deliver_held(c);
      if (settle == detail::Settle::drop) {
        c.watch.kept.clear();
        kill(c);
      }
    }
    for (auto& copy : control->replays) {
      auto& c = connections.emplace_back();
      c.orphan = true;
      c.watch.id = ++next_connection;
      c.watch.replay_of = copy;
      c.up.bytes.assign(copy->bytes.begin(), copy->bytes.end());
      start_connect(c);
      if (c.server < 0) ++copy->replays_failed;
    }
    control->replays.clear();
  }

  // How long poll() may sleep: until the first orphan is due to close or the first rest of a
  // delivery is due (-1: no limit; a cut link acts on neither).
  int poll_timeout(bool forwarding) const {
    if (!forwarding) return -1;
    std::optional<Clock::time_point> first;
    for (const auto& c : connections) {
      for (const auto& due : {c.close_by, c.watch.rest_due}) {
        if (due && (!first || *due < *first)) first = due;
      }
    }
    if (!first) return -1;
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(*first - Clock::now()).count();
    return static_cast<int>(std::max<long long>(left, 0)) + 1;
  }

  // What the callers asked for, as the thread's loop acts on it.
  struct Settings {
    Mode mode;
    bool drop_once;
    bool pass;
    std::uint64_t drop_serial;
    std::uint64_t resets;
    std::uint64_t requested;  // the requests these settings answer
  };

  // Reads the settings and acts on the held and copied requests' calls; nullopt to stop.
  std::optional<Settings> look() {
    std::lock_guard lock(mutex);
    if (stop) return std::nullopt;
    settle_requests();
    return Settings{mode, drop_next, pass_one, drop_serial, reset_requested, control->requested};
  }

  // Resets every connection when asked, connects new ones onwards, forgets finished ones.
  void tidy(const Settings& now) {
    if (now.resets != resets_done) {
      for (auto& c : connections) kill(c);
      connections.clear();
      resets_done = now.resets;
    }
    if (now.mode == Mode::blackhole) return;
    for (auto it = connections.begin(); it != connections.end();) {
      if (!it->connect_started && it->client >= 0) start_connect(*it);
      it = (it->client < 0 && it->server < 0) ? connections.erase(it) : std::next(it);
    }
  }

  void poll_list(std::vector<pollfd>& fds, const Settings& now) const {
    const bool forwarding = now.mode != Mode::blackhole;
    const bool reading = now.mode != Mode::hold_replies || now.pass;
    fds.clear();
    fds.push_back({control->wake, POLLIN, 0});
    fds.push_back({listener, POLLIN, 0});
    for (const auto& c : connections) {
      fds.push_back({c.client, client_events(c, forwarding), 0});
      fds.push_back({c.server, server_events(c, forwarding, reading), 0});
    }
  }

  void run() {
    std::vector<pollfd> fds;
    while (auto now = look()) {
      tidy(*now);
      {
        // Everything requested before the look above is now in force.
        std::lock_guard lock(mutex);
        control->observed = now->requested;
      }
      seen.notify_all();
      open.store(connections.size());
      poll_list(fds, *now);
      if (::poll(fds.data(), fds.size(), poll_timeout(now->mode != Mode::blackhole)) < 0) {
        if (errno == EINTR) continue;
        break;
      }
      if (fds[0].revents & POLLIN) {
        std::uint64_t count;
        (void)!::read(control->wake, &count, sizeof count);
      }
      bool pass = now->pass;
      bool drop_once = now->drop_once;
      std::size_t index = 2;
      for (auto it = connections.begin(); it != connections.end(); index += 2) {
        const bool keep = serve(*it, fds[index].revents, fds[index + 1].revents, now->mode, drop_once, pass);
        it = keep ? std::next(it) : connections.erase(it);
      }
      consumed(*now, drop_once, pass);
      if (fds[1].revents & POLLIN) accept_all();
    }
    for (auto& c : connections) kill(c);
    connections.clear();
    open.store(0);
    {
      std::lock_guard lock(mutex);
      control->stopped = true;
    }
    seen.notify_all();
  }

  // Clears a one-shot drop or pass that a round used up.
  void consumed(const Settings& now, bool drop_once, bool pass) {
    if (!drop_once) {
      // Consumed; unless a newer drop_next_reply() came meanwhile.
      std::lock_guard lock(mutex);
      if (drop_serial == now.drop_serial) drop_next = false;
    }
    if (now.pass && !pass) {
      {
        std::lock_guard lock(mutex);
        pass_one = false;
      }
      seen.notify_all();
    }
  }
};

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
  state_->control->wake = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (state_->control->wake < 0) fail("eventfd");
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
  ::close(state_->control->wake);
}

std::uint16_t TcpProxy::port() const { return state_->port; }

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
  if (state_->seen.wait_for(lock, wait, [&] { return !state_->pass_one || state_->control->stopped; }))
    return !state_->control->stopped;
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

namespace {

// A new hold or copy for `pattern`, armed in `records` (the proxy's mutex held by the caller).
template <typename Record>
std::shared_ptr<Record> arm(std::vector<std::shared_ptr<Record>>& records, const std::string& pattern, int nth) {
  if (pattern.empty() || nth < 1) throw std::invalid_argument("TcpProxy: a late request needs a pattern and nth >= 1");
  auto record = std::make_shared<Record>();
  record->pattern = pattern;
  record->nth = nth;
  records.push_back(record);
  return record;
}

}  // namespace

std::shared_ptr<HeldRequest> TcpProxy::hold_request(const std::string& pattern, int nth) {
  std::lock_guard lock(state_->mutex);
  return std::make_shared<HeldRequest>(state_->control, arm(state_->control->armed, pattern, nth));
}

std::shared_ptr<DuplicatedRequest> TcpProxy::duplicate_request(const std::string& pattern, int nth) {
  std::lock_guard lock(state_->mutex);
  return std::make_shared<DuplicatedRequest>(state_->control, arm(state_->control->copies, pattern, nth));
}

std::size_t TcpProxy::open_connections() const { return state_->open.load(); }
std::uint64_t TcpProxy::accepted() const { return state_->accepted.load(); }
std::uint64_t TcpProxy::dropped_bytes() const { return state_->dropped.load(); }

}  // namespace turnstile_test
