// SPDX-License-Identifier: Apache-2.0
#include "acquire.hpp"

#include <algorithm>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#include <unistd.h>

#include "common.hpp"
#include "run_options.hpp"

namespace turnstile::cli {

namespace {

// `elect`: the value defaults to HOST:PID, which names this candidate to whoever reads the leader.
std::string leader_value(const RunOptions& options) {
  if (options.leader_value) return *options.leader_value;
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  return std::string(host) + ":" + std::to_string(getpid());
}

std::optional<Hold> campaign(Client& client, const std::string& name, const RunOptions& options, const Wait& wait,
                             std::stop_token stop) {
  auto election = std::make_shared<Election>(client.election(name));
  const auto value = leader_value(options);
  const bool leads = !wait ? election->campaign_until(value, std::chrono::steady_clock::now())
                           : election->campaign_until(value, *wait, std::move(stop));
  if (!leads) return std::nullopt;
  return Hold{election->fencing_token(),
              election->lost_token(),
              [election] { election->resign(); },
              election->release_receipt(),
              [](std::chrono::milliseconds) {
                throw InvalidArgument("--hold-at-least does not apply to an election: its leader resigns");
              },
              value};
}

}  // namespace

std::optional<Hold> acquire(Client& client, Kind kind, const std::string& name, const RunOptions& options,
                            const Wait& wait, std::stop_token stop) {
  const bool once = !wait.has_value();
  const bool forever = wait.has_value() && !wait->has_value();
  // The stop-token overloads take a duration; the deadline counts from before the first try.
  const auto left = [&] {
    return std::max(std::chrono::steady_clock::duration::zero(), **wait - std::chrono::steady_clock::now());
  };
  switch (kind) {
    case Kind::election: return campaign(client, name, options, wait, std::move(stop));
    case Kind::lock: {
      auto mutex = std::make_shared<Mutex>(client.mutex(name));
      const bool got = once ? mutex->try_lock() : forever ? mutex->lock(stop) : mutex->try_lock_for(left(), stop);
      if (!got) return std::nullopt;
      return Hold{mutex->fencing_token(), mutex->lost_token(), [mutex] { mutex->release(); }, mutex->release_receipt(),
                  [mutex](std::chrono::milliseconds keep_for) { mutex->release_after(keep_for); }};
    }
    case Kind::read:
    case Kind::write: {
      auto rw = std::make_shared<SharedMutex>(client.shared_mutex(name));
      bool got;
      if (kind == Kind::read) {
        got = once ? rw->try_lock_shared() : forever ? rw->lock_shared(stop) : rw->try_lock_shared_for(left(), stop);
      } else {
        got = once ? rw->try_lock() : forever ? rw->lock(stop) : rw->try_lock_for(left(), stop);
      }
      if (!got) return std::nullopt;
      auto release = kind == Kind::read ? std::function<void()>([rw] { rw->release_shared(); })
                                        : std::function<void()>([rw] { rw->release(); });
      using KeepFor = std::chrono::milliseconds;
      auto release_after = kind == Kind::read
                               ? std::function<void(KeepFor)>([rw](KeepFor keep) { rw->release_shared_after(keep); })
                               : std::function<void(KeepFor)>([rw](KeepFor keep) { rw->release_after(keep); });
      return Hold{rw->fencing_token(), rw->lost_token(), std::move(release), rw->release_receipt(),
                  std::move(release_after)};
    }
    case Kind::semaphore: {
      auto semaphore = client.semaphore(name, *options.limit);
      std::optional<Lease> lease = once      ? semaphore.try_acquire()
                                   : forever ? semaphore.acquire(1, stop)
                                             : semaphore.try_acquire_for(left(), 1, stop);
      if (!lease) return std::nullopt;
      auto shared = std::make_shared<Lease>(std::move(*lease));
      return Hold{shared->fencing_token(), shared->lost_token(), [shared] { shared->release(); },
                  shared->release_receipt(),
                  [shared](std::chrono::milliseconds keep_for) { shared->release_after(keep_for); }};
    }
  }
  return std::nullopt;
}

void give_back(Hold& hold, const RunOptions& options, std::chrono::steady_clock::time_point held_from) {
  const auto at_least = options.hold_at_least ? parse_duration(*options.hold_at_least) : std::nullopt;
  if (!at_least) return hold.release();
  const auto left =
      std::chrono::ceil<std::chrono::milliseconds>(held_from + *at_least - std::chrono::steady_clock::now());
  if (left <= std::chrono::milliseconds::zero()) return hold.release();
  try {
    hold.release_after(left);
  } catch (const BackendUnavailable& error) {
    throw KeepUnconfirmed(error.what());
  }
}

const std::string& hold_name(const RunOptions& o) {
  return o.lock ? *o.lock : o.read ? *o.read : o.write ? *o.write : o.elect ? *o.elect : *o.semaphore;
}

std::string what_is_held(Kind kind, const std::string& name, const RunOptions& options) {
  const auto quoted = "'" + printable(name) + "'";
  switch (kind) {
    case Kind::lock: return "the lock " + quoted;
    case Kind::read: return "the read side of " + quoted;
    case Kind::write: return "the write side of " + quoted;
    case Kind::semaphore:
      return "a lease of the semaphore " + quoted + " (limit " + std::to_string(*options.limit) + ")";
    case Kind::election: return "the leadership of " + quoted;
  }
  return quoted;
}

void release_within(Hold& hold, std::chrono::steady_clock::duration bound) {
  struct Done {
    std::mutex mutex;
    std::condition_variable changed;
    bool done = false;
  };
  auto done = std::make_shared<Done>();
  std::thread([&hold, done] {
    try {
      hold.release();
    } catch (...) {
      // Lost, or unreachable: either way, nothing more to do here.
    }
    std::lock_guard lock(done->mutex);
    done->done = true;
    done->changed.notify_all();
  }).detach();
  std::unique_lock lock(done->mutex);
  done->changed.wait_for(lock, bound, [&] { return done->done; });
}

}  // namespace turnstile::cli
