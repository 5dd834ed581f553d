// SPDX-License-Identifier: Apache-2.0
#include "backends/redis/connection.hpp"

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
namespace {

using std::chrono::milliseconds;
constexpr auto kFirstBackoff = milliseconds(50);

}  // namespace

// A script call sent without waiting for its reply (send_pipelined).
struct Connection::Owed {
  std::string call;  // "script NAME", for messages
  Answer answer;
};

struct Connection::Link {
  Context context;
  std::string server;  // Opened::server
  std::uint64_t generation = 0;
  SteadyClock::time_point last_reply{};
  bool used = false;          // completed a call
  std::vector<Owed> pending;  // replies the server owes on this link, in order

  // A link closed (dropped, or its Connection ending) with replies owed: their outcome is unknown.
  ~Link() {
    for (auto& owed : pending) {
      Result failed;
      failed.error = std::make_exception_ptr(
          BackendUnavailable("the connection to redis closed before the reply to " + owed.call + " came"));
      owed.answer(std::move(failed));
    }
  }
};

namespace {

// True when an idle link's socket shows nothing: anything readable on a request/response
// connection between calls is an EOF (Redis' `timeout`, a restart), a reset, or garbage.
bool looks_alive(const redisContext* context) {
  pollfd pfd{context->fd, POLLIN | POLLRDHUP, 0};
  int ready;
  do {
    ready = poll(&pfd, 1, 0);
  } while (ready < 0 && errno == EINTR);
  return ready == 0;
}

}  // namespace

Connection::Connection(Settings settings, std::vector<const Script*> scripts,
                       std::function<void(const std::string&)> on_server_changed, std::chrono::milliseconds max_backoff,
                       bool connect_now)
    : settings_(std::move(settings)), scripts_(std::move(scripts)), on_server_changed_(std::move(on_server_changed)),
      max_backoff_(std::max(max_backoff, kFirstBackoff)) {
  if (!connect_now) return;
  // One attempt: Client::connect reports a bad URL, password or ACL at once.
  Wait wait(SteadyClock::now());
  if (settings_.connect_by) wait.until = *settings_.connect_by;
  ++links_;
  std::unique_ptr<Link> link;
  try {
    link = open_link(wait);
  } catch (...) {
    --links_;
    throw;
  }
  checkin(std::move(link));
}

Connection::~Connection() = default;

bool Connection::wait_returned(std::unique_lock<std::mutex>& lock, SteadyClock::time_point until,
                               const std::stop_token& stop) {
  const auto seen = returns_;
  const auto returned = [&] { return returns_ != seen; };
  if (until == SteadyClock::time_point::max()) return returned_.wait(lock, stop, returned);
  return returned_.wait_until(lock, stop, until, returned);
}

void Connection::notify_returned() {
  ++returns_;
  returned_.notify_all();
}

std::unique_ptr<Connection::Link> Connection::open_link(const Wait& wait) {
  auto opened = open_context(settings_, wait, &scripts_, wait.cancel_fd);
  auto link = std::make_unique<Link>();
  link->context = std::move(opened.context);
  link->server = opened.server;
  link->last_reply = SteadyClock::now();
  bool changed = false;
  bool replacing_lost = false;
  std::vector<std::unique_ptr<Link>> stale;
  {
    std::lock_guard lock(mutex_);
    if (shas_.empty()) shas_ = std::move(opened.shas);  // the first link's; SHA1s never change
    replacing_lost = std::exchange(lost_a_link_, false);
    // Another boot of the server (run_id; unknown when INFO is refused), or with sentinels
    // another server altogether.
    if (!opened.run_id.empty() || settings_.sentinel()) {
      changed = !server_.empty() && opened.server != server_;
      server_ = opened.server;
    }
    if (changed) {
      ++generation_;
      // Idle links lead to the server we knew: gone.
      links_ -= static_cast<int>(idle_.size());
      stale.swap(idle_);
    }
    link->generation = generation_;
  }
  stale.clear();
  if (settings_.reports) settings_.reports->connected(replacing_lost);
  if (changed && on_server_changed_) on_server_changed_(link->server);
  return link;
}

std::unique_ptr<Connection::Link> Connection::checkout(const Wait& wait) {
  std::unique_lock lock(mutex_);
  for (;;) {
    if (wait.stop.stop_requested()) {
      throw BackendUnavailable("the call to redis at " + settings_.description + " was cancelled (stop requested)");
    }
    if (auto link = take_idle_locked()) {
      lock.unlock();
      // Owed replies make the socket readable: the exchange that reads them shows it alive.
      if (!link->pending.empty() || looks_alive(link->context.get())) return link;
      link.reset();
      lock.lock();
      --links_;
      continue;
    }
    if (links_ < kMaxLinks) {
      if (SteadyClock::now() < next_attempt_) {
        if (wait.try_once || wait.fail_fast || wait.until < next_attempt_) {
          throw BackendUnavailable("redis at " + settings_.description + " is unreachable (reconnecting)");
        }
        wait_returned(lock, next_attempt_, wait.stop);
        continue;
      }
      ++links_;
      if (auto link = open_counted(lock, wait)) return link;
      continue;
    }
    // Every link is busy with another call: wait for one, within our own deadline.
    if (!wait_returned(lock, wait.until, wait.stop) && !wait.stop.stop_requested() && idle_.empty() &&
        links_ >= kMaxLinks) {
      throw BackendUnavailable("every connection to redis at " + settings_.description +
                               " stayed busy until the deadline");
    }
  }
}

std::unique_ptr<Connection::Link> Connection::take_idle_locked() {
  if (idle_.empty()) return nullptr;
  // The most recently used that owes replies (so a call goes out after them, on their
  // connection), else the most recently used: the least likely to be stale.
  auto owing = std::find_if(idle_.rbegin(), idle_.rend(), [](const auto& link) { return !link->pending.empty(); });
  const auto it = owing == idle_.rend() ? std::prev(idle_.end()) : std::prev(owing.base());
  auto link = std::move(*it);
  idle_.erase(it);
  return link;
}

void Connection::answer(std::vector<Owed>& owed, std::vector<Reply>& replies, const std::string& failure,
                        const std::string& server) const {
  for (std::size_t i = 0; i < owed.size(); ++i) {
    Result result;
    result.server = server;
    if (i < replies.size()) {
      result.error = reply_error(settings_, owed[i].call, replies[i].get());
      if (result.ok()) result.reply = std::move(replies[i]);
    } else {
      result.error = std::make_exception_ptr(BackendUnavailable("redis at " + settings_.description + " failed (" +
                                                                failure + ") before answering " + owed[i].call +
                                                                "; the outcome is unknown"));
    }
    owed[i].answer(std::move(result));
  }
}

bool Connection::settle_owed(std::unique_ptr<Link>& link, const Wait& wait) {
  auto owed = std::exchange(link->pending, {});
  std::vector<Reply> replies;
  const auto why = read_replies(link->context.get(), owed.size(), replies, wait.reply_until(), wait.cancel_fd);
  const auto server = link->server;
  if (why.empty()) {
    link->last_reply = SteadyClock::now();
  } else {
    discard(std::move(link), false);
  }
  answer(owed, replies, why, server);
  return why.empty();
}

bool Connection::send_pipelined(const Script& script, const std::vector<std::string>& keys,
                                const std::vector<std::string>& args, Answer answer) {
  auto command = eval_command(script, keys, args, true);
  if (command.front() != "EVALSHA") return false;  // not loaded yet: eval() loads it
  std::unique_ptr<Link> link;
  {
    std::lock_guard lock(mutex_);
    link = take_idle_locked();
  }
  if (!link) return false;
  if (link->pending.empty() && !looks_alive(link->context.get())) {
    discard(std::move(link), false);
    return false;
  }
  std::string out;
  if (!append_command(out, command)) {
    checkin(std::move(link));
    return false;
  }
  link->pending.push_back({"script " + script.name, std::move(answer)});
  // A few hundred bytes into an idle socket's buffer: written at once, or the link is broken.
  if (!write_all(link->context.get(), out, SteadyClock::now() + kReplyTimeout).empty()) {
    discard(std::move(link), false);  // its answers (this one too) learn the outcome is unknown
    return true;
  }
  checkin(std::move(link));
  return true;
}

void Connection::collect_pending(SteadyClock::time_point until) {
  std::vector<std::unique_ptr<Link>> owing;  // out of the pool meanwhile, still counted in links_
  {
    std::lock_guard lock(mutex_);
    for (auto it = idle_.begin(); it != idle_.end();) {
      if ((*it)->pending.empty()) {
        ++it;
        continue;
      }
      owing.push_back(std::move(*it));
      it = idle_.erase(it);
    }
  }
  const Wait wait(until);
  for (auto& link : owing) {
    if (settle_owed(link, wait)) checkin(std::move(link));
  }
}

std::unique_ptr<Connection::Link> Connection::open_counted(std::unique_lock<std::mutex>& lock, const Wait& wait) {
  lock.unlock();
  std::exception_ptr failure;
  bool may_retry = false;
  try {
    return open_link(wait);
  } catch (const EvictingServer&) {
    failure = std::current_exception();  // it will not pass: never retried
  } catch (const BackendUnavailable&) {
    failure = std::current_exception();
    may_retry = true;
  } catch (...) {
    failure = std::current_exception();  // AccessDenied: retrying would not help either
  }
  lock.lock();
  --links_;
  if (may_retry && !wait.stop.stop_requested()) {  // a cancelled attempt says nothing of the server
    backoff_ = std::clamp(backoff_ * 2, kFirstBackoff, max_backoff_);
    next_attempt_ = SteadyClock::now() + backoff_;
  }
  notify_returned();
  if (!may_retry || wait.try_once || wait.fail_fast || wait.until < next_attempt_ || wait.stop.stop_requested()) {
    std::rethrow_exception(failure);
  }
  return nullptr;
}

void Connection::checkin(std::unique_ptr<Link> link) {
  std::lock_guard lock(mutex_);
  if (link->used) backoff_ = milliseconds(0);
  if (link->generation != generation_) {
    --links_;
  } else {
    idle_.push_back(std::move(link));
  }
  notify_returned();
}

void Connection::discard(std::unique_ptr<Link> link, bool fresh) {
  link.reset();
  std::lock_guard lock(mutex_);
  --links_;
  lost_a_link_ = true;
  if (fresh) {
    // A connection that fails before completing a call counts as a failed attempt: no
    // reconnect storm against a server that accepts and then drops us.
    backoff_ = std::clamp(backoff_ * 2, kFirstBackoff, max_backoff_);
    next_attempt_ = SteadyClock::now() + backoff_;
  }
  notify_returned();
}

void Connection::follow(const std::string& server) {
  if (!settings_.sentinel()) return;
  std::vector<std::unique_ptr<Link>> stale;
  {
    std::lock_guard lock(mutex_);
    if (server_.empty() || server_ == server) return;
    server_ = server;
    ++generation_;  // busy links are dropped when they come back
    links_ -= static_cast<int>(idle_.size());
    stale.swap(idle_);
    notify_returned();
  }
}

bool Connection::primary_moved(const std::string& address) {
  if (!settings_.sentinel()) return false;
  std::vector<std::unique_ptr<Link>> stale;
  {
    std::lock_guard lock(mutex_);
    if (server_.empty() || server_.substr(0, server_.find(' ')) == address) return false;
    ++generation_;
    links_ -= static_cast<int>(idle_.size());
    stale.swap(idle_);
    notify_returned();
  }
  return true;
}

void Connection::forget_idle() {
  std::vector<std::unique_ptr<Link>> stale;
  {
    std::lock_guard lock(mutex_);
    links_ -= static_cast<int>(idle_.size());
    stale.swap(idle_);
    notify_returned();
  }
}

std::vector<Reply> Connection::run(const std::vector<Command>& commands, const Wait& wait, const CallOptions& options) {
  const bool asking = options.asking;
  const auto* follow_up = options.follow_up;
  std::vector<Command> asked;
  if (asking) {
    asked.push_back({"ASKING"});
    asked.insert(asked.end(), commands.begin(), commands.end());
  }
  for (;;) {
    auto link = checkout(wait);  // throws once a stop is requested
    // What must not be resent goes only to a link shown alive: its owed replies show it first.
    if (!options.idempotent && !link->pending.empty() && !settle_owed(link, wait)) continue;
    if (!options.idempotent && !shown_alive(link, wait)) continue;
    bool sent = false;
    std::vector<Reply> replies;
    // Our commands go out at once; the replies owed from before come first.
    auto owed = std::exchange(link->pending, {});
    std::vector<Reply> earlier;
    const auto why = exchange(link->context.get(), asking ? asked : commands, replies, wait.reply_until(),
                              wait.cancel_fd, &sent, {owed.size(), &earlier});
    if (!owed.empty()) answer(owed, earlier, why, link->server);
    if (why.empty() && asking) replies.erase(replies.begin());  // ASKING's OK
    if (why.empty()) {
      link->last_reply = SteadyClock::now();
      link->used = true;
      if (settings_.sentinel() && std::any_of(replies.begin(), replies.end(),
                                              [](const Reply& reply) { return is_error(reply.get(), "READONLY"); })) {
        // The primary was demoted under us: nothing was written (a replica refuses every
        // write). The call goes out again to the primary the sentinels name now.
        discard(std::move(link), false);
        forget_idle();
        if (wait.expired() || wait.stop.stop_requested()) {
          throw BackendUnavailable("redis at " + settings_.description +
                                   " is no longer a primary (READONLY) and no new one answered in time");
        }
        continue;
      }
      if (options.server) *options.server = link->server;
      if (follow_up && *follow_up && !send_follow_up(*link, replies, wait, options)) {
        discard(std::move(link), false);
        return replies;
      }
      checkin(std::move(link));
      return replies;
    }
    const bool fresh = !link->used && !wait.stop.stop_requested();
    discard(std::move(link), fresh);
    if (sent && !options.idempotent) {
      throw BackendUnavailable("redis at " + settings_.description + " failed mid-request (" + why +
                               "); the outcome is unknown");
    }
    if (wait.expired() || wait.stop.stop_requested()) {
      throw BackendUnavailable("redis at " + settings_.description + " failed: " + why);
    }
  }
}

bool Connection::shown_alive(std::unique_ptr<Link>& link, const Wait& wait) {
  if (SteadyClock::now() - link->last_reply < kIdleProbe) return true;
  // What must not be resent is written only to a connection just shown alive: one the server
  // closed (`timeout`) or a NAT dropped while idle fails this PING instead, and the call goes
  // out on a new connection rather than reporting an unknown outcome.
  std::vector<Reply> pong;
  if (const auto why = exchange(link->context.get(), std::vector<Command>{Command{"PING"}}, pong, wait.reply_until(),
                                wait.cancel_fd);
      !why.empty()) {
    discard(std::move(link), false);
    if (wait.expired()) {
      throw BackendUnavailable("redis at " + settings_.description + " did not answer (" + why + "); nothing was sent");
    }
    return false;
  }
  link->last_reply = SteadyClock::now();
  return true;
}

bool Connection::send_follow_up(Link& link, const std::vector<Reply>& replies, const Wait& wait,
                                const CallOptions& options) {
  auto next = (*options.follow_up)(replies);
  if (!next) return true;
  std::vector<Reply> more;
  // Bounded by the follow-up's own timeout (WAIT's is below kConnectTimeout).
  if (!exchange(link.context.get(), std::vector<Command>{*next}, more, SteadyClock::now() + kReplyTimeout,
                wait.cancel_fd)
           .empty()) {
    return false;
  }
  link.last_reply = SteadyClock::now();
  if (options.follow_reply) *options.follow_reply = std::move(more.front());
  return true;
}

Command Connection::eval_command(const Script& script, const std::vector<std::string>& keys,
                                 const std::vector<std::string>& args, bool by_sha) {
  const auto index = static_cast<std::size_t>(std::find(scripts_.begin(), scripts_.end(), &script) - scripts_.begin());
  std::string sha;
  if (by_sha) {
    // Known once a first link loaded the scripts (a cluster's node connects at its first call:
    // until then EVAL, which loads the script too).
    std::lock_guard lock(mutex_);
    if (index < shas_.size()) sha = shas_[index];
  }
  Command command{sha.empty() ? "EVAL" : "EVALSHA", sha.empty() ? script.body : sha, std::to_string(keys.size())};
  command.insert(command.end(), keys.begin(), keys.end());
  command.insert(command.end(), args.begin(), args.end());
  return command;
}

std::vector<Result> Connection::run_scripts(const std::vector<ScriptCall>& calls, const Wait& wait,
                                            CallOptions options) {
  std::string answered;
  if (!options.server) options.server = &answered;
  const auto* follow_up = options.follow_up;
  std::vector<Command> commands;
  for (const auto& [script, keys, args] : calls) commands.push_back(eval_command(*script, keys, args, true));
  // No follow-up after a NOSCRIPT: it goes after the EVAL that runs the script instead.
  FollowUp unless_noscript;
  if (follow_up && *follow_up) {
    unless_noscript = [follow_up](const std::vector<Reply>& replies) -> std::optional<Command> {
      for (const auto& reply : replies) {
        if (is_error(reply.get(), "NOSCRIPT")) return std::nullopt;
      }
      return (*follow_up)(replies);
    };
  }
  auto first = options;
  first.follow_up = &unless_noscript;
  auto replies = run(commands, wait, first);
  // The server lost its script cache (restart, SCRIPT FLUSH): those scripts did not run; EVAL
  // sends and caches them, in one more round trip.
  std::vector<std::size_t> missing;
  commands.clear();
  for (std::size_t i = 0; i < replies.size(); ++i) {
    if (!is_error(replies[i].get(), "NOSCRIPT")) continue;
    const auto& [script, keys, args] = calls[i];
    missing.push_back(i);
    commands.push_back(eval_command(*script, keys, args, false));
  }
  if (!missing.empty()) {
    auto again = run(commands, wait, options);
    for (std::size_t k = 0; k < missing.size(); ++k) replies[missing[k]] = std::move(again[k]);
  }
  std::vector<Result> results(calls.size());
  for (std::size_t i = 0; i < calls.size(); ++i) {
    results[i].error = reply_error(settings_, "script " + std::get<0>(calls[i])->name, replies[i].get());
    if (results[i].ok()) results[i].reply = std::move(replies[i]);
    results[i].server = *options.server;
  }
  return results;
}

Result Connection::eval_result(const Script& script, const std::vector<std::string>& keys,
                               const std::vector<std::string>& args, const CallOptions& options) {
  const StopFd cancel(options.budget.stop());
  const Wait wait(options.budget.deadline(), options.budget.stop(), cancel.fd());
  return std::move(run_scripts({ScriptCall{&script, keys, args}}, wait, options).front());
}

std::vector<Result> Connection::eval_each(const std::vector<ScriptCall>& calls, const CallBudget& budget,
                                          std::string* server) {
  const StopFd cancel(budget.stop());
  return run_scripts(calls, Wait(budget.deadline(), budget.stop(), cancel.fd()),
                     {.budget = budget, .idempotent = true, .server = server});
}

std::vector<Reply> Connection::eval_pipelined(const std::vector<ScriptCall>& calls, const CallBudget& budget) {
  auto results = eval_each(calls, budget);
  std::vector<Reply> replies;
  for (auto& result : results) replies.push_back(result.take());
  return replies;
}

bool Connection::watch_idle(SteadyClock::time_point until, int wake_fd) {
  const int fd = lend_idle();
  // Between calls nothing may arrive on a request/response connection: anything readable is an
  // EOF, a reset, or garbage (see looks_alive).
  pollfd fds[2] = {{wake_fd, POLLIN, 0}, {fd, POLLIN | POLLRDHUP, 0}};
  for (;;) {
    const int ready = poll(fds, fd >= 0 ? 2 : 1, poll_timeout(until));
    if (ready >= 0 || errno != EINTR) break;
  }
  return take_back_idle(fd >= 0 && fds[1].revents != 0);
}

int Connection::lend_idle() {
  std::lock_guard lock(mutex_);
  // A link owing replies is readable by design: not one to watch for a server going away.
  if (lent_ || idle_.empty() || !idle_.back()->pending.empty()) return -1;
  lent_ = std::move(idle_.back());
  idle_.pop_back();
  return lent_->context->fd;
}

bool Connection::take_back_idle(bool readable) {
  std::unique_ptr<Link> link;
  {
    std::lock_guard lock(mutex_);
    link = std::move(lent_);
  }
  if (!link) return false;
  if (readable) {
    discard(std::move(link), false);
    return true;
  }
  checkin(std::move(link));
  return false;
}

Result Connection::command_result(const Command& command, CallOptions options) {
  const StopFd cancel(options.budget.stop());
  Result result;
  options.idempotent = true;
  options.server = &result.server;
  Wait wait(options.budget.deadline(), options.budget.stop(), cancel.fd());
  wait.fail_fast = options.fail_fast;
  auto replies = run({command}, wait, options);
  result.error = reply_error(settings_, command.front(), replies.front().get());
  if (result.ok()) result.reply = std::move(replies.front());
  return result;
}

}  // namespace turnstile::detail::redis