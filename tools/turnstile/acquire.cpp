#include "acquire.hpp"

#include <algorithm>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#include "common.hpp"

namespace turnstile::cli {

std::optional<Hold> acquire(Client& client, Kind kind, const std::string& name, const RunOptions& options,
                            const Wait& wait, std::stop_token stop) {
  const bool once = !wait.has_value();
  const bool forever = wait.has_value() && !wait->has_value();
  // The stop-token overloads take a duration; the deadline counts from before the first try.
  const auto left = [&] {
    return std::max(std::chrono::steady_clock::duration::zero(), **wait - std::chrono::steady_clock::now());
  };
  switch (kind) {
    case Kind::lock: {
      auto mutex = std::make_shared<Mutex>(client.mutex(name));
      const bool got = once ? mutex->try_lock() : forever ? mutex->lock(stop) : mutex->try_lock_for(left(), stop);
      if (!got) return std::nullopt;
      return Hold{mutex->fencing_token(), mutex->lost_token(), [mutex] { mutex->release(); }};
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
      return Hold{rw->fencing_token(), rw->lost_token(), std::move(release)};
    }
    case Kind::semaphore: {
      auto semaphore = client.semaphore(name, *options.limit);
      std::optional<Lease> lease = once      ? semaphore.try_acquire()
                                   : forever ? semaphore.acquire(1, stop)
                                             : semaphore.try_acquire_for(left(), 1, stop);
      if (!lease) return std::nullopt;
      auto shared = std::make_shared<Lease>(std::move(*lease));
      return Hold{shared->fencing_token(), shared->lost_token(), [shared] { shared->release(); }};
    }
  }
  return std::nullopt;
}

const std::string& hold_name(const RunOptions& o) {
  return o.lock ? *o.lock : o.read ? *o.read : o.write ? *o.write : *o.semaphore;
}

std::string what_is_held(Kind kind, const std::string& name, const RunOptions& options) {
  const auto quoted = "'" + printable(name) + "'";
  switch (kind) {
    case Kind::lock: return "the lock " + quoted;
    case Kind::read: return "the read side of " + quoted;
    case Kind::write: return "the write side of " + quoted;
    case Kind::semaphore:
      return "a lease of the semaphore " + quoted + " (limit " + std::to_string(*options.limit) + ")";
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
