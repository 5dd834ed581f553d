// SPDX-License-Identifier: Apache-2.0
#include "backends/consul/sessions.hpp"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "backends/consul/refusals.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail::consul {
namespace {

using std::chrono::milliseconds;

// A renewal that got no answer is tried again this soon (the lease's deadline is what counts).
constexpr milliseconds kRenewRetry{500};
// Destroying sessions (lost ones, or all at shutdown) takes this long at most, all of them: the
// server invalidates what is left after TTL x 2 anyway.
constexpr milliseconds kDestroyTimeout{1000};
// Renewals and destroys in flight at once, each on its own connection: a round of many sessions
// then takes about one reply's time per this many (one after another, a slow server's replies
// added up past the TTL), while a client stays far below Consul's http_max_conns_per_client (200).
constexpr std::size_t kParallel = 32;

std::string go_duration(milliseconds value) { return std::to_string(value.count()) + "ms"; }

}  // namespace

Sessions::Sessions(const Endpoint& endpoint, Http& calls, SessionSettings settings)
    : calls_(calls), renewals_(endpoint), settings_(std::move(settings)) {
  thread_ = std::jthread([this](std::stop_token stop) { run(stop); });
}

Sessions::~Sessions() {
  thread_.request_stop();  // ends a round under way at once (its requests are cut)
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::vector<std::string> ids = std::move(to_destroy_);
  for (const auto& session : all_) ids.push_back(session->id);
  destroy(ids, {});
}

std::string Sessions::create_id(milliseconds ttl, milliseconds lock_delay, milliseconds timeout) {
  const nlohmann::json request = {{"Name", settings_.name},
                                  {"TTL", go_duration(ttl)},
                                  {"Behavior", "delete"},
                                  // No node health check (Consul adds serfHealth unless told): its
                                  // failure would end the session at once, before the holder's own
                                  // clock could tell it, and readers and leases have no lock-delay.
                                  // The TTL, which the holder tracks, is the session's only end.
                                  {"Checks", nlohmann::json::array()},
                                  {"LockDelay", go_duration(lock_delay)}};
  // The name is for people (inspect, Consul's UI): a host name that is not UTF-8 is shown with
  // U+FFFD rather than refused.
  const auto body = request.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  const auto reply = calls_.call("PUT", "/v1/session/create", body, timeout);
  // The caller's setting, not an outage.
  if (refused_session_ttl(reply)) {
    throw InvalidArgument("Consul at " + calls_.endpoint().shown + " refused the session TTL of " +
                          std::to_string(ttl.count()) + " ms (" + reply.body.substr(0, 200) +
                          "); set ttl= within the server's session_ttl_min (10 s by default) and 24 h");
  }
  if (reply.status != 200) throw_error("creating a session", reply, calls_.endpoint());
  const auto answer = nlohmann::json::parse(reply.body, nullptr, false);
  if (!answer.is_object() || !answer.contains("ID") || !answer["ID"].is_string()) {
    throw BackendUnavailable("Consul at " + calls_.endpoint().shown + " answered a session create without an ID");
  }
  return answer["ID"].get<std::string>();
}

std::shared_ptr<Session> Sessions::create(milliseconds timeout) {
  const auto sent_at = SteadyClock::now();
  auto session = std::make_shared<Session>();
  session->id = create_id(settings_.ttl, settings_.lock_delay, timeout);
  session->lease = clock_.watch(settings_.ttl, sent_at);
  std::lock_guard lock(mutex_);
  all_.push_back(session);
  wake_.notify_all();
  return session;
}

std::string Sessions::create_unrenewed(milliseconds ttl, milliseconds timeout, milliseconds& applied) {
  constexpr milliseconds kDefaultMinimum{10000};  // Consul's session_ttl_min
  const auto whole = std::chrono::ceil<std::chrono::seconds>(ttl);
  try {
    auto id = create_id(whole, milliseconds::zero(), timeout);
    applied = whole;
    return id;
  } catch (const InvalidArgument&) {
    if (whole >= kDefaultMinimum) throw;
    auto id = create_id(kDefaultMinimum, milliseconds::zero(), timeout);
    applied = kDefaultMinimum;
    return id;
  }
}

std::shared_ptr<Session> Sessions::main(milliseconds timeout) {
  {
    std::lock_guard lock(mutex_);
    if (main_ && !main_->lease->lost()) return main_;
  }
  auto fresh = create(timeout);
  std::lock_guard lock(mutex_);
  if (main_ && !main_->lease->lost()) {
    to_destroy_.push_back(fresh->id);  // another thread made one first
    fresh->lease->lose("not needed");
    return main_;
  }
  main_ = fresh;
  return main_;
}

std::shared_ptr<Session> Sessions::spare(milliseconds timeout) {
  {
    std::lock_guard lock(mutex_);
    while (!spares_.empty()) {
      auto session = std::move(spares_.back());
      spares_.pop_back();
      if (!session->lease->lost()) return session;
    }
  }
  return create(timeout);
}

void Sessions::give_back(std::shared_ptr<Session> session) {
  if (session->lease->lost()) return;
  std::lock_guard lock(mutex_);
  spares_.push_back(std::move(session));
}

bool Sessions::renew(const std::vector<std::shared_ptr<Session>>& due, const std::stop_token& stop) {
  std::vector<Request> renewals;
  // A renewal is confirmed by its send time, so a late answer still counts: each may take up to
  // TTL/2 (when the next round is due), and the round ends by the last loss deadline among them
  // (past it, every lease of the round is lost whatever the answer). A shorter timeout never
  // counted a server that answers renewals slowly but surely, and lost every hold on it.
  auto until = SteadyClock::time_point::min();
  for (const auto& session : due) {
    renewals.push_back({"PUT", "/v1/session/renew/" + session->id, ""});
    until = std::max(until, session->lease->loss_deadline());
  }
  const auto outcomes = renewals_.call_each(renewals, kParallel, settings_.ttl / 2, until, stop);
  auto* reports = renewals_.endpoint().reports;
  bool all_confirmed = true;
  for (std::size_t i = 0; i < due.size(); ++i) {
    auto& session = *due[i];
    const auto& outcome = outcomes[i];
    if (outcome.stopped) return false;  // shutting down: nothing learned
    if (outcome.reply && outcome.reply->status == 200) {
      session.lease->confirmed(outcome.sent_at);  // by the send time: the server renewed after it
      if (reports) reports->renewed(outcome.answered_at - outcome.sent_at);
      continue;
    }
    if (outcome.reply && outcome.reply->status == 404) {
      session.lease->lose("Consul says session " + session.id + " is gone (invalidated or destroyed)",
                          LossCause::session_expired);
      continue;
    }
    const auto trouble =
        outcome.reply
            ? "Consul answered a session renewal with HTTP " + std::to_string(outcome.reply->status)
            : "no answer to a session renewal from Consul at " + renewals_.endpoint().shown + ": " + outcome.error;
    session.lease->unconfirmed(trouble);
    if (reports) reports->renewal_failed(trouble);
    all_confirmed = false;
  }
  return all_confirmed;
}

void Sessions::destroy(const std::vector<std::string>& ids, const std::stop_token& stop) noexcept {
  try {
    std::vector<Request> destroys;
    for (const auto& id : ids) destroys.push_back({"PUT", "/v1/session/destroy/" + id, ""});
    // Unanswered ones are left to the server, which invalidates them after TTL x 2.
    renewals_.call_each(destroys, kParallel, kDestroyTimeout, SteadyClock::now() + kDestroyTimeout, stop);
  } catch (...) {
    // No memory for the requests: the same.
  }
}

void Sessions::run(std::stop_token stop) {
  auto next = SteadyClock::now() + settings_.ttl / 2;
  while (!stop.stop_requested()) {
    std::vector<std::shared_ptr<Session>> due;
    std::vector<std::string> destroying;
    {
      std::unique_lock lock(mutex_);
      wake_.wait_until(lock, stop, next, [&] { return !to_destroy_.empty(); });
      if (stop.stop_requested()) return;
      destroying.swap(to_destroy_);
      if (SteadyClock::now() >= next) {
        std::erase_if(all_, [&](const auto& session) {
          if (!session->lease->lost()) return false;
          destroying.push_back(session->id);
          return true;
        });
        due = all_;
      }
    }
    destroy(destroying, stop);
    if (due.empty() && SteadyClock::now() < next) continue;
    // The next round is due TTL/2 after this one was sent, not after its (maybe slow) answers.
    const auto round_sent = SteadyClock::now();
    const bool all_confirmed = renew(due, stop);
    next = all_confirmed ? std::max(round_sent + settings_.ttl / 2, SteadyClock::now() + kRenewRetry / 5)
                         : SteadyClock::now() + kRenewRetry;
  }
}

}  // namespace turnstile::detail::consul
