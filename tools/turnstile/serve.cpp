// SPDX-License-Identifier: Apache-2.0
// `turnstile serve`: one thread looks at the backend at a bounded rate, with a deadline per
// look, and publishes what it saw; the HTTP server's threads only read what was published. Each
// live page (an SSE stream, /events) has a thread of the server's pool to itself, waiting for
// the next change: a slow or dead page costs its own thread until the write timeout, never the
// others', and the streams open at once are bounded.
#include <httplib.h>
#include <pthread.h>
#include <sys/socket.h>

#include <atomic>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <memory>
#include <mutex>
#include <stop_token>
#include <thread>

#include "common.hpp"
#include "serve.hpp"

namespace turnstile::cli {
namespace {

// The most one look at the backend may take: a server that does not answer shows as an error
// on the page instead of a page that stops changing.
constexpr auto kLookTime = std::chrono::seconds(5);
// A live page hears at least this often (an SSE comment, a few bytes) that the server is still
// there: the write is also what finds a page that went away (its place is then free again).
constexpr auto kKeepAlive = std::chrono::seconds(2);
// A page that does not take what is written within this time is dropped.
constexpr auto kWriteTimeout = std::chrono::seconds(5);
constexpr auto kIdleTimeout = std::chrono::seconds(2);

struct Published {
  ServedState state;
  std::string fragment;       // the page's state part, what /events sends
  std::uint64_t version = 0;  // raised when the fragment changes, ages aside
};

// The fragment as of a look, ages left out: equal for two looks that saw the same state.
std::string signature_of(const ServedState& state) {
  ServedState timeless = state;
  timeless.taken = {};
  return render_state_fragment(timeless);
}

class StatePoller {
 public:
  StatePoller(Client& client, const ServeOptions& options) : client_(client), options_(options) {
    previous_.backend = backend_shown(client);
    previous_.prefix = options.prefix;
  }

  // Publishes one look; then again every interval until stopped.
  void publish_one() { publish(look()); }
  void run(std::stop_token stop) {
    const auto interval =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::duration<double>(options_.interval_sec));
    std::unique_lock lock(mutex_);
    while (!stop.stop_requested()) {
      changed_.wait_for(lock, stop, interval, [] { return false; });
      if (stop.stop_requested()) break;
      lock.unlock();
      publish(look());
      lock.lock();
    }
  }

  std::shared_ptr<const Published> latest() const {
    std::lock_guard lock(mutex_);
    return latest_;
  }
  // The state once its version differs from `seen`, or at the latest after `timeout`; nullptr
  // when the server is stopping.
  std::shared_ptr<const Published> next_after(std::uint64_t seen, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    changed_.wait_for(lock, timeout, [&] { return stopping_ || latest_->version != seen; });
    return stopping_ ? nullptr : latest_;
  }
  void stop() {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    changed_.notify_all();
  }

 private:
  ServedState look() {
    ServedState next = previous_;
    ++next.polls;
    try {
      const auto deadline = SteadyClock::now() + kLookTime;
      const auto names = client_.names_in_use(options_.prefix, options_.max_names, deadline);
      next.queues.clear();
      for (const auto& in_use : names.names) {
        auto queue = client_.inspect(in_use.name, deadline);
        // Left between the listing and this look: not in use any more.
        if (!queue.holders.empty() || !queue.waiters.empty()) next.queues.push_back(std::move(queue));
      }
      next.truncated = names.truncated;
      next.error.clear();
    } catch (const std::exception& error) {
      // What was seen last stays on the page, under the error (the library's errors name no
      // credentials). Anything else thrown here is a failed look too, not the end of serving.
      ++next.failed_polls;
      next.error = error.what();
    }
    next.taken = std::chrono::system_clock::now();
    previous_ = next;
    return next;
  }

  void publish(ServedState state) {
    auto signature = signature_of(state);
    auto published = std::make_shared<Published>();
    published->fragment = render_state_fragment(state);
    published->state = std::move(state);
    std::lock_guard lock(mutex_);
    published->version = latest_ ? latest_->version : 0;
    if (!latest_ || signature != signature_) ++published->version;
    signature_ = std::move(signature);
    latest_ = std::move(published);
    changed_.notify_all();
  }

  Client& client_;
  const ServeOptions& options_;
  ServedState previous_;  // the poller thread's own
  mutable std::mutex mutex_;
  std::condition_variable_any changed_;
  std::shared_ptr<const Published> latest_;
  std::string signature_;
  bool stopping_ = false;
};

// An SSE message carrying `data`: one "data:" field per line.
std::string event_message(const std::string& data) {
  std::string out;
  std::size_t start = 0;
  while (start < data.size()) {
    auto end = data.find('\n', start);
    if (end == std::string::npos) end = data.size();
    out += "data: " + data.substr(start, end - start) + "\n";
    start = end + 1;
  }
  return out + "\n";
}

class WebServer {
 public:
  WebServer(Client& client, StatePoller& poller, const ServeOptions& options, bool loopback)
      : client_(client), poller_(poller), options_(options) {
    // The live pages, and room besides them; a connection that sends nothing holds a thread for
    // at most kIdleTimeout (idle keep-alive connections once kept /metrics waiting 27 s).
    const auto threads = options.max_live_pages + 16;
    server_.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
    server_.set_write_timeout(kWriteTimeout);
    server_.set_read_timeout(kIdleTimeout);
    server_.set_keep_alive_timeout(kIdleTimeout.count());
    // SO_REUSEADDR (a restart binds again at once), but not cpp-httplib's SO_REUSEPORT: with it a
    // second serve on the same port would share it silently, each answering some requests.
    server_.set_socket_options([](int socket) {
      const int yes = 1;
      setsockopt(socket, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    });
    if (loopback) guard_host_header();
    add_routes();
  }

  // The port bound (the one chosen when `port` is 0), or -1 (errno may say why).
  int bind(const std::string& host, int port) {
    if (port == 0) return server_.bind_to_any_port(host);
    return server_.bind_to_port(host, port) ? port : -1;
  }
  bool serve() { return server_.listen_after_bind(); }
  void stop() { server_.stop(); }

 private:
  void guard_host_header() {
    server_.set_pre_routing_handler([](const httplib::Request& request, httplib::Response& response) {
      // One Host header naming loopback; two are a malformed request (RFC 9112 3.2), refused too.
      if (request.get_header_value_count("Host") == 1 && host_header_is_loopback(request.get_header_value("Host"))) {
        return httplib::Server::HandlerResponse::Unhandled;
      }
      response.status = 421;
      response.set_content("this server answers requests for a loopback address only\n", "text/plain");
      return httplib::Server::HandlerResponse::Handled;
    });
  }

  void add_routes() {
    server_.set_post_routing_handler([](const httplib::Request&, httplib::Response& response) {
      response.set_header("Cache-Control", "no-store");
      response.set_header("X-Content-Type-Options", "nosniff");
      response.set_header("Content-Security-Policy",
                          "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
                          "connect-src 'self'; img-src 'self'");
    });
    server_.Get("/", [this](const httplib::Request&, httplib::Response& response) {
      response.set_content(render_page(poller_.latest()->state), "text/html; charset=utf-8");
    });
    server_.Get("/state.json", [this](const httplib::Request&, httplib::Response& response) {
      response.set_content(render_state_json(poller_.latest()->state, following_.load()), "application/json");
    });
    server_.Get("/metrics", [this](const httplib::Request&, httplib::Response& response) {
      // What the backend shows, then what the serving client itself counted (its looks' round
      // trips, renewals, connections): families of their own names, none twice.
      auto text = render_backend_metrics(poller_.latest()->state, options_.name_label, following_.load(),
                                         std::chrono::system_clock::now());
      text += client_.metrics().prometheus_text();
      response.set_content(text, "text/plain; version=0.0.4; charset=utf-8");
    });
    server_.Get("/events", [this](const httplib::Request&, httplib::Response& response) { follow(response); });
  }

  // Takes one of the live pages' places; false when all are taken.
  bool take_place() {
    auto open = streams_.load();
    do {
      if (open >= options_.max_live_pages) return false;
    } while (!streams_.compare_exchange_weak(open, open + 1));
    return true;
  }

  // /events: the state now, then again at each change, until the page goes away.
  void follow(httplib::Response& response) {
    if (!take_place()) {
      response.status = 503;
      response.set_content("too many live pages open (--max-live-pages); reload later\n", "text/plain");
      return;
    }
    struct Stream {
      std::uint64_t seen = 0;  // the version sent last (0: none yet)
      bool following = false;  // counted in following_ (the first message was sent)
    };
    auto stream = std::make_shared<Stream>();
    response.set_chunked_content_provider(
        "text/event-stream",
        [this, stream](std::size_t, httplib::DataSink& sink) {
          const auto published = stream->seen == 0 ? poller_.latest() : poller_.next_after(stream->seen, kKeepAlive);
          if (!published) {
            sink.done();
            return true;
          }
          const auto message =
              published->version != stream->seen ? event_message(published->fragment) : std::string(": alive\n\n");
          if (!sink.write(message.data(), message.size())) return false;
          stream->seen = published->version;
          if (!stream->following) ++following_;
          stream->following = true;
          return true;
        },
        [this, stream](bool) {
          if (stream->following) --following_;
          --streams_;
        });
  }

  Client& client_;
  StatePoller& poller_;
  const ServeOptions& options_;
  httplib::Server server_;
  std::atomic<std::size_t> streams_{0};    // live pages' places taken
  std::atomic<std::size_t> following_{0};  // live pages that got the state at least once
};

// SIGINT, SIGTERM and SIGHUP, blocked in every thread (threads made later inherit the mask) and
// taken by sigtimedwait in the main thread.
sigset_t ending_signals() {
  sigset_t set;
  sigemptyset(&set);
  for (const int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, sig);
  return set;
}

// Waits for an ending signal (true), or for the server to end by itself (`ended`: false).
bool wait_for_the_end(const sigset_t& signals, const std::atomic<bool>& ended) {
  const timespec quarter_second{0, 250'000'000};
  while (!ended.load()) {
    if (sigtimedwait(&signals, nullptr, &quarter_second) > 0) return true;
  }
  return false;
}

Client connect_for_serving(const ServeOptions& options) {
  ClientOptions client_options;
  client_options.connect_timeout = std::max(
      std::chrono::milliseconds(1),
      std::chrono::ceil<std::chrono::milliseconds>(std::chrono::duration<double>(options.connect_timeout_sec)));
  return connect_backend(options.backend, std::move(client_options));
}

}  // namespace

int serve_command(const ServeOptions& options) {
  ListenAddress address;
  try {
    address = parse_listen_address(options.listen);
  } catch (const Error& error) {
    complain(error.what());
    return kExitUsage;
  }
  if (!address.loopback && !options.allow_remote) {
    complain("refusing to listen on " + address_text(address.host, address.port) +
             ": not a loopback address, and the page and /metrics show every name in use and who holds it to "
             "anyone who can reach them (add --allow-remote to serve them there)");
    return kExitUsage;
  }
  const auto signals = ending_signals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);  // a page that went away is a failed write, not the end
  try {
    auto client = connect_for_serving(options);
    StatePoller poller(client, options);
    poller.publish_one();
    WebServer server(client, poller, options, address.loopback);
    const int port = server.bind(address.host, address.port);
    if (port < 0) {
      complain(describe_errno("cannot listen on " + address_text(address.host, address.port)));
      return kExitOsError;
    }
    std::printf("turnstile serve: listening on http://%s/\n", address_text(address.host, port).c_str());
    std::fflush(stdout);
    std::atomic<bool> ended{false};
    std::jthread polling([&poller](std::stop_token stop) { poller.run(stop); });
    std::thread serving([&] {
      server.serve();
      ended = true;
    });
    const bool signalled = wait_for_the_end(signals, ended);
    polling.request_stop();
    poller.stop();  // the live pages end their streams
    server.stop();
    serving.join();
    if (signalled) return 0;
    complain("the HTTP server stopped accepting connections on " + address_text(address.host, port));
    return kExitOsError;
  } catch (const Error& error) {
    complain(error.what());
    return exit_status_for(error);
  }
}

}  // namespace turnstile::cli
