// SPDX-License-Identifier: Apache-2.0
// The public Client: connecting (the default URL, the backend by scheme) and making primitives.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>

#include "backends/file/directory.hpp"
#include "core/backend_loader.hpp"
#include "core/client_state.hpp"
#include "core/text_escape.hpp"
#include "turnstile/lock.hpp"
#include "turnstile/permit_counter.hpp"
#include "turnstile/semaphore.hpp"

namespace turnstile {
namespace {

// What a file:// URL's path keeps as it is: all but '%', the bytes that would end the path or
// split the URL (' ', '?', '#') and control bytes.
bool kept_in_a_url_path(unsigned char c) {
  return c != '%' && c != ' ' && c != '?' && c != '#' && c >= 0x20 && c != 0x7f;
}

}  // namespace

const char* to_string(HoldState state) noexcept {
  switch (state) {
    case HoldState::held: return "held";
    case HoldState::suspended: return "suspended";
    case HoldState::lost: return "lost";
  }
  return "unknown";
}

// The host-wide namespace first: the directory the Debian package makes (tmpfiles.d: root's,
// group turnstile, mode 2770), used by every process that may use it (root and the group's
// members), so that `sudo turnstile` and a member's `turnstile` exclude each other as flock on
// one path does. Only a root-owned one counts: a member who owned it could swap it; connect()
// refuses one that is not as the package makes it rather than split the namespace.
//
// Else one directory per user that every process of the user agrees on, whatever its session's
// environment (a cron job has no XDG_RUNTIME_DIR, a login shell does: two defaults would let
// both hold the same lock). /run/lock is the system's lock directory: a root-owned sticky tmpfs
// that no tmp cleaner ages and that does not vanish at logout, as /run/user/UID does. Where it
// is missing (or not root's and sticky), /tmp, which cleaners may age out.
std::string Client::default_url() {
  // A misconfigured one is still this process's (connect refuses it): never a silent split.
  if (detail::file_state::host_wide_problem(host_wide_directory)) return std::string("file://") + host_wide_directory;
  const auto uid = std::to_string(::geteuid());
  struct stat lock_dir {};
  const bool run_lock = ::stat("/run/lock", &lock_dir) == 0 && S_ISDIR(lock_dir.st_mode) && lock_dir.st_uid == 0 &&
                        (lock_dir.st_mode & S_ISVTX) != 0;
  const auto directory = (run_lock ? "/run/lock/turnstile-" : "/tmp/turnstile-") + uid;
  return "file://" + detail::percent_encode(directory, kept_in_a_url_path);
}

Client Client::connect() { return connect(ClientOptions{}); }

Client Client::connect(ClientOptions options) {
  const char* env = std::getenv("TURNSTILE_BACKEND");
  if (!env || !*env) return connect(default_url(), std::move(options));
  try {
    return connect(std::string(env), std::move(options));
  } catch (const InvalidUrl& error) {
    // The caller gave no URL: say where the bad one came from.
    throw InvalidUrl(std::string(error.what()) + "; the URL came from TURNSTILE_BACKEND");
  }
}

const char* version() noexcept { return TURNSTILE_VERSION; }

Client Client::connect(std::string_view url_text, ClientOptions options) {
  if (options.async_threads == 0 || options.async_threads > 64) {
    throw InvalidArgument("async_threads must be between 1 and 64, got " + std::to_string(options.async_threads));
  }
  if (options.holder_label.size() > 256) {
    throw InvalidArgument("the holder label is " + std::to_string(options.holder_label.size()) +
                          " bytes; at most 256 are kept");
  }
  for (const unsigned char c : options.holder_label) {
    if (c < 0x20 || c == 0x7f) throw InvalidArgument("the holder label contains a control character");
  }
  // "" and a file:// URL without a directory mean the embedded default (not TURNSTILE_BACKEND:
  // a URL was given).
  const auto url = detail::parse_url(url_text.empty() || url_text == "file://" ? default_url() : url_text);
  if (url.text == std::string("file://") + host_wide_directory) {
    if (const auto problem = detail::file_state::host_wide_problem(host_wide_directory); problem && !problem->empty()) {
      throw AccessDenied(*problem);
    }
  }
  auto connected = detail::connect_backend(url, options);
  return Client(std::make_shared<detail::ClientState>(url.text, std::move(connected.backend), std::move(options),
                                                      connected.usable_after_fork, std::move(connected.telemetry)));
}

Client::Client(std::shared_ptr<detail::ClientState> state) : state_(std::move(state)) {}

const std::string& Client::url() const { return state_->url(); }

Mutex Client::mutex(std::string_view name) {
  detail::validate_name(name);
  return Mutex(state_->thread_holds(std::string(name)), detail::Primitive::mutex);
}

RecursiveMutex Client::recursive_mutex(std::string_view name) {
  detail::validate_name(name);
  return RecursiveMutex(state_->thread_holds(std::string(name)), detail::Primitive::recursive_mutex);
}

SharedMutex Client::shared_mutex(std::string_view name) {
  detail::validate_name(name);
  return SharedMutex(state_->thread_holds(std::string(name)), detail::Primitive::shared_mutex);
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

bool Client::can_release_after(bool semaphore_lease) const {
  return state_->backend().keeps_released_holds(semaphore_lease ? detail::EntryKind::lease
                                                                : detail::EntryKind::exclusive);
}

Inspection Client::inspect(std::string_view name) {
  detail::validate_name(name);
  return state_->backend().inspect(std::string(name), std::nullopt);
}

Inspection Client::inspect(std::string_view name, SteadyClock::time_point deadline) {
  detail::validate_name(name);
  return state_->backend().inspect(std::string(name), deadline);
}

bool Client::release_receipt(std::string_view receipt, SteadyClock::time_point deadline) {
  if (receipt.empty()) return false;
  return state_->backend().release_receipt(std::string(receipt), deadline);
}

std::vector<std::string> Client::collect_unused(std::string_view prefix) {
  return state_->backend().collect_unused(std::string(prefix));
}

void Client::set_error_handler(ErrorHandler handler) { state_->set_error_handler(std::move(handler)); }

Metrics Client::metrics() const { return state_->metrics(); }

}  // namespace turnstile
