#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>

#include "core/client_state.hpp"
#include "core/fork_generation.hpp"
#include "turnstile/lock.hpp"
#include "turnstile/permit_counter.hpp"
#include "turnstile/semaphore.hpp"

namespace turnstile {
namespace detail {

std::unique_ptr<Backend> make_file_backend(const BackendUrl& url, const ClientOptions& options);

void LossSignal::lose(const std::string& reason, std::chrono::milliseconds margin) noexcept {
  std::lock_guard order(tell_mutex_);  // so a callback of this thread may lose it again (recursive)
  if (mark_lost(reason, margin)) tell_lost();
}

bool LossSignal::mark_lost(const std::string& reason, std::chrono::milliseconds margin) noexcept {
  std::lock_guard lock(mutex_);
  if (lost()) return false;  // only the first report counts, and calls back once
  reason_ = reason.empty() ? "unknown reason" : reason;
  margin_ = margin;
  state_.store(HoldState::lost, std::memory_order_release);
  return true;
}

void LossSignal::tell_lost() noexcept {
  std::lock_guard order(tell_mutex_);
  std::stop_source source{std::nostopstate};
  std::string reason;
  std::chrono::milliseconds margin;
  {
    std::lock_guard lock(mutex_);
    source = source_;  // a token() from now on sees the state and makes its state stopped
    reason = reason_;
    margin = margin_;
  }
  if (source.stop_possible()) source.request_stop();  // outside the lock: runs stop_callbacks
  tell(HoldState::lost, reason, margin);
}

void LossSignal::suspend(const std::string& reason) noexcept {
  std::lock_guard order(tell_mutex_);
  if (change_state(HoldState::suspended)) tell(HoldState::suspended, reason);
}

void LossSignal::resume() noexcept {
  std::lock_guard order(tell_mutex_);
  if (change_state(HoldState::held)) tell(HoldState::held, {});
}

bool LossSignal::change_state(HoldState next) noexcept {
  std::lock_guard lock(mutex_);
  if (lost() || state() == next) return false;
  state_.store(next, std::memory_order_release);
  return true;
}

void LossSignal::tell(HoldState state, const std::string& reason, std::chrono::milliseconds margin) noexcept {
  if (!callbacks_) return;
  const auto token = fencing_token_.load(std::memory_order_relaxed);
  // A throwing user callback must not take the backend's watcher thread down.
  try {
    if (state == HoldState::lost && callbacks_->on_lost) {
      callbacks_->on_lost(HoldLost("hold on '" + name_ + "' (fencing token " + std::to_string(token) +
                                   ") may have been lost: " + reason));
    }
  } catch (...) {
  }
  try {
    if (callbacks_->on_state) callbacks_->on_state(HoldStateChange{name_, token, state, reason, margin});
  } catch (...) {
  }
}

std::stop_token LossSignal::token() const {
  std::lock_guard lock(mutex_);
  if (!source_.stop_possible()) {
    source_ = std::stop_source();
    // No callback can be registered yet, so requesting here runs nothing under the lock.
    if (lost() || past_due()) source_.request_stop();
  }
  return source_.get_token();
}

std::string LossSignal::reason() const {
  std::lock_guard lock(mutex_);
  if (reason_.empty() && past_due()) return "no renewal was confirmed before its loss deadline";
  return reason_;
}

HoldRecord::HoldRecord(std::shared_ptr<ClientState> client, std::string name, std::int64_t permits,
                       std::unique_ptr<BackendHold> hold, std::shared_ptr<LossSignal> loss)
    : client_(std::move(client)),
      name_(std::move(name)),
      permits_(permits),
      token_(hold->fencing_token()),
      hold_(std::move(hold)),
      loss_(std::move(loss)),
      fork_generation_(fork_generation()) {
  loss_->set_fencing_token(token_);
}

HoldRecord::~HoldRecord() {
  if (!hold_) return;
  if (!owned_by_this_process()) {
    hold_.reset();  // the parent's hold: a child leaving never releases it
    return;
  }
  try {
    release();
  } catch (const Error& error) {
    client_->report(error);
  }
}

bool HoldRecord::owned_by_this_process() const { return fork_generation_ == fork_generation(); }

void HoldRecord::release() {
  if (!hold_) throw NotHeld("'" + name_ + "' was already released");
  auto hold = std::move(hold_);
  if (!owned_by_this_process()) {
    throw HoldLost("the hold on '" + name_ + "' (fencing token " + std::to_string(token_) +
                   ") was inherited across fork(): it is the parent's, and the child neither holds nor releases it");
  }
  try {
    hold->release();
  } catch (const BackendUnavailable& error) {
    client_->retry_release_later(name_, std::move(hold));
    // A hold already reported lost is reported as lost: that is what the caller must act on.
    if (loss_->lost_by_now()) {
      throw HoldLost("hold on '" + name_ + "' (fencing token " + std::to_string(token_) +
                     ") may have been lost before its release: " + loss_->reason() +
                     "; its release is retried in the background");
    }
    throw BackendUnavailable("release of '" + name_ + "' failed and is retried in the background: " +
                             error.what());
  }
  if (loss_->lost_by_now()) {
    throw HoldLost("hold on '" + name_ + "' (fencing token " + std::to_string(token_) +
                   ") may have been lost before its release: " + loss_->reason());
  }
}

ClientState::ClientState(std::string url, std::unique_ptr<Backend> backend, ClientOptions options,
                         bool usable_after_fork)
    : url_(std::move(url)), backend_(std::move(backend)), usable_after_fork_(usable_after_fork),
      fork_generation_(fork_generation()), options_(std::move(options)),
      error_handler_(options_.error_handler),
      hold_callbacks_(options_.on_hold_lost || options_.on_hold_state
                          ? std::make_shared<const LossSignal::Callbacks>(
                                LossSignal::Callbacks{options_.on_hold_lost, options_.on_hold_state})
                          : nullptr) {}

ClientState::~ClientState() {
  // In a forked child, the parent's threads do not exist and its connections and pending
  // releases are the parent's: nothing of the parent's is joined, closed or released.
  const auto generation = fork_generation();
  if (retrier_.joinable()) {
    if (retrier_generation_ != generation) {
      static_cast<void>(new std::jthread(std::move(retrier_)));  // no thread to join here
    } else {
      retrier_.request_stop();
      retry_cv_.notify_all();
      retrier_.join();
    }
  }
  // One last attempt for releases still pending: the process may be about to exit.
  for (auto& pending : pending_) {
    if (pending.fork_generation != generation) {
      static_cast<void>(pending.hold.release());
      continue;
    }
    try {
      pending.hold->release();
    } catch (const Error& error) {
      report(BackendUnavailable("giving up the release of '" + pending.name + "': " + error.what()));
    }
  }
  if (!usable_after_fork_ && fork_generation_ != generation) static_cast<void>(backend_.release());
}

Backend& ClientState::backend() {
  if (!usable_after_fork_ && fork_generation_ != fork_generation()) {
    throw BackendUnavailable("this client of '" + url_ +
                             "' was connected before fork(): its connections belong to the parent; connect a new "
                             "Client in the child");
  }
  return *backend_;
}

void ClientState::report(const Error& error) noexcept {
  ErrorHandler handler;
  {
    std::lock_guard lock(handler_mutex_);
    handler = error_handler_;
  }
  try {
    if (handler) {
      handler(error);
      return;
    }
  } catch (...) {
  }
  std::fprintf(stderr, "turnstile: %s\n", error.what());
}

void ClientState::set_error_handler(ErrorHandler handler) {
  std::lock_guard lock(handler_mutex_);
  error_handler_ = std::move(handler);
}

std::shared_ptr<LossSignal> ClientState::new_loss_signal(const std::string& name) {
  return std::make_shared<LossSignal>(name, hold_callbacks_);
}

std::shared_ptr<LockCore> ClientState::lock_core(const std::string& name) {
  std::lock_guard lock(cores_mutex_);
  auto& slot = cores_[name];
  if (auto core = slot.lock()) return core;
  auto core = std::make_shared<LockCore>(shared_from_this(), name);
  slot = core;
  return core;
}

std::unique_ptr<HoldRecord> ClientState::acquire(const QueueRequest& request, Deadline deadline) {
  if (request.stop.stop_requested()) return nullptr;  // never joins a queue it would leave at once
  auto loss = new_loss_signal(request.name);
  auto hold = acquire_in_queue(backend(), request, deadline, loss);
  if (!hold) return nullptr;
  return std::make_unique<HoldRecord>(shared_from_this(), request.name, request.permits,
                                      std::move(hold), std::move(loss));
}

void ClientState::retry_release_later(std::string name, std::unique_ptr<BackendHold> hold) {
  std::lock_guard lock(retry_mutex_);
  constexpr auto first_backoff = std::chrono::milliseconds(100);
  const auto generation = fork_generation();
  if (retrier_generation_ != generation) {
    // First failed release in a forked child: the parent's retrier and releases are not ours.
    if (retrier_.joinable()) static_cast<void>(new std::jthread(std::move(retrier_)));
    for (auto& pending : pending_) static_cast<void>(pending.hold.release());
    pending_.clear();
  }
  pending_.push_back({std::move(name), std::move(hold), first_backoff, SteadyClock::now() + first_backoff, generation});
  if (!retrier_.joinable()) {
    retrier_ = std::jthread([this](std::stop_token stop) { retry_loop(stop); });
    retrier_generation_ = generation;
  }
  retry_cv_.notify_all();
}

void ClientState::retry_loop(std::stop_token stop) {
  constexpr auto max_backoff = std::chrono::milliseconds(5000);
  std::unique_lock lock(retry_mutex_);
  while (!stop.stop_requested()) {
    if (pending_.empty()) {
      retry_cv_.wait(lock, stop, [&] { return !pending_.empty(); });
      continue;
    }
    auto due = pending_.front().next_try;
    for (auto& p : pending_) due = std::min(due, p.next_try);
    if (retry_cv_.wait_until(lock, stop, due, [] { return false; }); stop.stop_requested()) break;
    // The due releases are tried without the mutex: a new failed release must not wait behind
    // this retry's network round (up to the backend's release patience).
    const auto now = SteadyClock::now();
    std::vector<PendingRelease> due_now;
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->next_try > now) {
        ++it;
      } else {
        due_now.push_back(std::move(*it));
        it = pending_.erase(it);
      }
    }
    lock.unlock();
    std::vector<PendingRelease> again;
    for (auto& pending : due_now) {
      try {
        pending.hold->release();
      } catch (const BackendUnavailable&) {
        pending.backoff = std::min(pending.backoff * 2, max_backoff);
        pending.next_try = SteadyClock::now() + pending.backoff;
        again.push_back(std::move(pending));
      } catch (const Error& error) {
        report(error);  // lost or refused: nothing left to release
      }
    }
    lock.lock();
    for (auto& pending : again) pending_.push_back(std::move(pending));
  }
}

namespace {

// Network backends live in their own shared libraries so the embedded path never pays for
// their dependencies: libturnstile-<scheme>.so in the private directory turnstile/ beside this
// library (installed), next to it (the build tree), or on the loader path. One thread at a
// time, under a lock every tool sees: glibc runs a library's static initializers under its
// own loader lock, which ThreadSanitizer does not see, so it reported a second thread's
// connect reading a script string the first thread's dlopen was constructing. Found
// factories are kept: one dlopen per family.
BackendFactory load_backend(const std::string& family) {
  static std::mutex mutex;
  static std::map<std::string, BackendFactory> loaded;
  std::lock_guard lock(mutex);
  if (const auto found = loaded.find(family); found != loaded.end()) return found->second;
  const std::string file = "libturnstile-" + family + ".so";
  std::vector<std::string> candidates;
  Dl_info self{};
  if (dladdr(reinterpret_cast<void*>(&load_backend), &self) && self.dli_fname) {
    const auto here = std::filesystem::path(self.dli_fname).parent_path();
    candidates.push_back((here / "turnstile" / file).string());
    candidates.push_back((here / file).string());
  }
  candidates.push_back(file);
  for (const auto& path : candidates) {
    if (void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL)) {
      if (void* symbol = dlsym(handle, "turnstile_backend_factory_v1")) {
        return loaded[family] = reinterpret_cast<BackendFactory>(symbol);
      }
      dlclose(handle);
    }
  }
  return nullptr;
}

std::string family_of(const std::string& scheme) {
  if (scheme == "file") return "file";
  if (scheme == "redis" || scheme == "rediss" || scheme == "redis+sentinel" || scheme == "rediss+sentinel" ||
      scheme == "redis+cluster" || scheme == "rediss+cluster") return "redis";
  if (scheme == "zk") return "zookeeper";
  if (scheme == "etcd" || scheme == "etcds") return "etcd";
  if (scheme == "consul" || scheme == "consuls") return "consul";
  return {};
}

std::string percent_encode_path(const std::string& path) {
  std::string out;
  for (unsigned char c : path) {
    if (c == '%' || c == ' ' || c == '?' || c == '#' || c < 0x20 || c == 0x7f) {
      char buf[4];
      std::snprintf(buf, sizeof buf, "%%%02X", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

}  // namespace
}  // namespace detail

const char* to_string(HoldState state) noexcept {
  switch (state) {
    case HoldState::held: return "held";
    case HoldState::suspended: return "suspended";
    case HoldState::lost: return "lost";
  }
  return "unknown";
}

// One directory per user that every process of the user agrees on, whatever its session's
// environment (a cron job has no XDG_RUNTIME_DIR, a login shell does: two defaults would let
// both hold the same lock). /run/lock is the system's lock directory: a root-owned sticky tmpfs
// that no tmp cleaner ages and that does not vanish at logout, as /run/user/UID does. Where it
// is missing (or not root's and sticky), /tmp, which cleaners may age out.
std::string Client::default_url() {
  const auto uid = std::to_string(::geteuid());
  struct stat lock_dir {};
  const bool run_lock = ::stat("/run/lock", &lock_dir) == 0 && S_ISDIR(lock_dir.st_mode) && lock_dir.st_uid == 0 &&
                        (lock_dir.st_mode & S_ISVTX) != 0;
  return "file://" + detail::percent_encode_path((run_lock ? "/run/lock/turnstile-" : "/tmp/turnstile-") + uid);
}

Client Client::connect() { return connect(ClientOptions{}); }

Client Client::connect(ClientOptions options) {
  const char* env = std::getenv("TURNSTILE_BACKEND");
  return connect(env && *env ? std::string(env) : default_url(), std::move(options));
}

const char* version() noexcept { return TURNSTILE_VERSION; }

Client Client::connect(std::string_view url_text, ClientOptions options) {
  if (options.holder_label.size() > 256) {
    throw InvalidArgument("the holder label is " + std::to_string(options.holder_label.size()) +
                          " bytes; at most 256 are kept");
  }
  for (const unsigned char c : options.holder_label) {
    if (c < 0x20 || c == 0x7f) throw InvalidArgument("the holder label contains a control character");
  }
  const auto url = detail::parse_url(url_text);
  const auto family = detail::family_of(url.scheme);
  if (family.empty()) {
    throw InvalidUrl("unknown backend scheme '" + url.scheme + "' in '" + url.text +
                     "' (expected file, redis, zk, etcd or consul)");
  }
  std::unique_ptr<detail::Backend> backend;
  if (family == "file") {
    backend = detail::make_file_backend(url, options);
  } else {
    auto factory = detail::load_backend(family);
    if (!factory) {
      throw BackendNotBuilt("the " + family + " backend for '" + url.scheme +
                            "://' is not installed (libturnstile-" + family + ".so not found)");
    }
    backend = factory(url, options);
  }
  // The embedded backend reopens its files in a forked child; the network backends' threads
  // and connections stay the parent's.
  const bool usable_after_fork = family == "file";
  return Client(std::make_shared<detail::ClientState>(url.text, std::move(backend), std::move(options), usable_after_fork));
}

Client::Client(std::shared_ptr<detail::ClientState> state) : state_(std::move(state)) {}

const std::string& Client::url() const { return state_->url(); }

Mutex Client::mutex(std::string_view name) {
  detail::validate_name(name);
  return Mutex(state_->lock_core(std::string(name)), detail::LockFlavor::plain);
}

RecursiveMutex Client::recursive_mutex(std::string_view name) {
  detail::validate_name(name);
  return RecursiveMutex(state_->lock_core(std::string(name)), detail::LockFlavor::recursive);
}

SharedMutex Client::shared_mutex(std::string_view name) {
  detail::validate_name(name);
  return SharedMutex(state_->lock_core(std::string(name)), detail::LockFlavor::read_write);
}

Semaphore Client::semaphore(std::string_view name, std::int64_t limit) {
  detail::validate_name(name);
  if (limit <= 0 || limit > max_permits) {
    throw InvalidArgument("Semaphore limit must be between 1 and " + std::to_string(max_permits) + ", got " +
                          std::to_string(limit));
  }
  return Semaphore(state_, std::string(name), limit);
}

PermitCounter Client::permit_counter(std::string_view name) {
  detail::validate_name(name);
  return PermitCounter(state_, std::string(name));
}

Inspection Client::inspect(std::string_view name) {
  detail::validate_name(name);
  return state_->backend().inspect(std::string(name), std::nullopt);
}

Inspection Client::inspect(std::string_view name, SteadyClock::time_point deadline) {
  detail::validate_name(name);
  return state_->backend().inspect(std::string(name), deadline);
}

void Client::set_error_handler(ErrorHandler handler) { state_->set_error_handler(std::move(handler)); }

}  // namespace turnstile
