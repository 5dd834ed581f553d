// SPDX-License-Identifier: Apache-2.0
#include "backends/file/byte_watch.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <condition_variable>
#include <utility>

namespace turnstile::detail::file_state {
namespace {

// A watcher thread only blocks in fcntl: it needs no megabytes of stack.
constexpr std::size_t kWatcherStack = 256 * 1024;

// A thread asleep until a byte is released, the deadline passes or a stop is requested.
class Waker final : public ReleaseListener {
 public:
  void released() override {
    {
      std::lock_guard lock(mutex_);
      woken_ = true;
    }
    cv_.notify_all();
  }
  void sleep(Deadline deadline) {
    std::unique_lock lock(mutex_);
    if (deadline) {
      cv_.wait_until(lock, *deadline, [&] { return woken_; });
    } else {
      cv_.wait(lock, [&] { return woken_; });
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool woken_ = false;
};

}  // namespace

// A thread blocked in F_OFD_SETLKW on one byte, on a description of its own. It ends when the
// byte is released (by leaving, or by its owner's death), waking everyone listening, or when
// its last listener stops listening (a deadline, a stop, another byte's release): it is then
// cancelled, which ends its blocked fcntl (a cancellation point, and the only point where it
// accepts cancellation) and closes its description. So a wait that ends leaves no thread or
// descriptor behind, however long the byte stays held.
struct ByteWatch {
  std::mutex mutex;
  bool released = false;
  bool finished = false;  // set by the thread as its last act: `thread` may be gone after it
  std::vector<std::shared_ptr<ReleaseListener>> listeners;
  pthread_t thread{};
  Fd fd;
  off_t offset = 0;

  // False when the byte was released already: the caller starts a new watch (so nobody is
  // told from inside its own call).
  bool listen_unless_released(const std::shared_ptr<ReleaseListener>& listener) {
    std::lock_guard lock(mutex);
    if (released) return false;
    listeners.push_back(listener);
    return true;
  }
  // Returns whether anyone still listens.
  bool unlisten(const std::shared_ptr<ReleaseListener>& listener) {
    std::lock_guard lock(mutex);
    std::erase(listeners, listener);
    return !listeners.empty();
  }
  // Ends the thread if it still waits (the caller made sure nobody listens or will).
  void cancel() {
    std::lock_guard lock(mutex);
    if (!finished) pthread_cancel(thread);  // the thread cannot exit while we hold the mutex
  }
  void finish() {
    std::vector<std::shared_ptr<ReleaseListener>> told;
    {
      std::lock_guard lock(mutex);
      released = true;
      finished = true;
      told = listeners;
    }
    for (auto& listener : told) listener->released();
  }
};

namespace {

void finish_byte_watch(void* argument) {
  std::unique_ptr<std::shared_ptr<ByteWatch>> owner(static_cast<std::shared_ptr<ByteWatch>*>(argument));
  ByteWatch& watch = **owner;
  watch.fd.reset();  // drops the read lock too, if we got it
  watch.finish();
}

// A failed wait is reported as a release too: the waiter looks at the queue again and decides.
void* run_byte_watch(void* argument) {
  int ignored;
  pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &ignored);
  auto& watch = **static_cast<std::shared_ptr<ByteWatch>*>(argument);
  struct flock fl {};
  fl.l_type = F_RDLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = watch.offset;
  fl.l_len = 1;
  pthread_cleanup_push(finish_byte_watch, argument);
  pthread_setcancelstate(PTHREAD_CANCEL_ENABLE, &ignored);
  while (fcntl(watch.fd.get(), F_OFD_SETLKW, &fl) != 0 && errno == EINTR) {
  }
  pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &ignored);
  pthread_cleanup_pop(1);
  return nullptr;
}

// Starts the thread with every signal blocked: the application's signals are not for it.
int start_watch_thread(ByteWatch& watch, std::shared_ptr<ByteWatch>* argument) {
  pthread_attr_t attributes;
  pthread_attr_init(&attributes);
  pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
  pthread_attr_setstacksize(&attributes, kWatcherStack);
  sigset_t all, previous;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &previous);
  const int rc = pthread_create(&watch.thread, &attributes, run_byte_watch, argument);
  pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  pthread_attr_destroy(&attributes);
  return rc;
}

}  // namespace

// Under mutex_: `listener` listens to the watch of `offset` unless that one saw the byte
// released already; then, or when there is none, to a new one, listening before its thread
// starts (which tells it, at once if the byte is free).
std::shared_ptr<ByteWatch> ByteWatches::listen_to_byte(off_t offset, const std::shared_ptr<ReleaseListener>& listener) {
  auto& slot = watches_[offset];
  if (slot && slot->listen_unless_released(listener)) return slot;
  const bool fresh_slot = !slot;
  auto watch = std::make_shared<ByteWatch>();
  watch->offset = offset;
  watch->listeners.push_back(listener);
  try {
    watch->fd = open_description_();
  } catch (...) {
    if (fresh_slot) watches_.erase(offset);
    throw;
  }
  auto* argument = new std::shared_ptr<ByteWatch>(watch);
  std::lock_guard lock(watch->mutex);  // `thread` is set before anyone may cancel
  if (const int rc = start_watch_thread(*watch, argument); rc != 0) {
    delete argument;
    if (fresh_slot) watches_.erase(offset);
    fail_io("cannot start a thread to wait for a lock byte", rc);
  }
  slot = watch;
  return watch;
}

ByteWatches::Listening ByteWatches::listen(const std::vector<off_t>& offsets,
                                           std::shared_ptr<ReleaseListener> listener) {
  Listening listening;
  listening.owner_ = this;
  listening.listener_ = std::move(listener);
  listening.watches_.reserve(offsets.size());
  std::lock_guard lock(mutex_);  // let go before `listening` stops listening on an exception
  for (off_t offset : offsets) listening.watches_.push_back(listen_to_byte(offset, listening.listener_));
  return listening;
}

ByteWatches::Listening::Listening(Listening&& other) noexcept
    : owner_(std::exchange(other.owner_, nullptr)), listener_(std::move(other.listener_)),
      watches_(std::move(other.watches_)) {}

ByteWatches::Listening& ByteWatches::Listening::operator=(Listening&& other) noexcept {
  if (this != &other) {
    if (owner_) owner_->stop_listening(*this);
    owner_ = std::exchange(other.owner_, nullptr);
    listener_ = std::move(other.listener_);
    watches_ = std::move(other.watches_);
  }
  return *this;
}

ByteWatches::Listening::~Listening() {
  if (owner_) owner_->stop_listening(*this);
}

void ByteWatches::stop_listening(Listening& listening) noexcept {
  std::lock_guard lock(mutex_);
  for (const auto& watch : listening.watches_) {
    if (watch->unlisten(listening.listener_)) continue;
    if (auto it = watches_.find(watch->offset); it != watches_.end() && it->second == watch) watches_.erase(it);
    watch->cancel();
  }
  listening.watches_.clear();
}

void ByteWatches::wait_for_any_release(const std::vector<off_t>& offsets, Deadline deadline,
                                       const std::stop_token& stop) {
  auto waker = std::make_shared<Waker>();
  const auto listening = listen(offsets, waker);
  std::stop_callback on_stop(stop, [&] { waker->released(); });
  waker->sleep(deadline);
}

}  // namespace turnstile::detail::file_state
