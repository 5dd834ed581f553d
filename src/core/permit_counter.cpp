// SPDX-License-Identifier: Apache-2.0
#include "turnstile/permit_counter.hpp"
#include "core/client_state.hpp"

namespace turnstile {
namespace {
void require_positive(const std::string& name, std::int64_t n) {
  if (n <= 0 || n > max_permits) {
    throw InvalidArgument("PermitCounter '" + name + "': the permit count must be between 1 and " +
                          std::to_string(max_permits) + ", got " + std::to_string(n));
  }
}
}  // namespace

PermitCounter::PermitCounter(std::shared_ptr<detail::ClientState> client, std::string name)
    : client_(std::move(client)), name_(std::move(name)) {}

bool PermitCounter::try_set_permits(std::int64_t n) {
  if (n < 0 || n > max_permits) {
    throw InvalidArgument("PermitCounter '" + name_ + "': the count must be between 0 and " +
                          std::to_string(max_permits) + ", got " + std::to_string(n));
  }
  return client_->backend().counter_try_set(name_, n);
}

std::int64_t PermitCounter::add_permits(std::int64_t n) {
  if (n < -max_permits || n > max_permits) {
    throw InvalidArgument("PermitCounter '" + name_ + "': a change must be between -" + std::to_string(max_permits) +
                          " and " + std::to_string(max_permits) + ", got " + std::to_string(n));
  }
  return client_->backend().counter_add(name_, n);
}

std::int64_t PermitCounter::available_permits() { return client_->backend().counter_get(name_).value_or(0); }

std::int64_t PermitCounter::drain_permits() { return client_->backend().counter_drain(name_); }

bool PermitCounter::acquire_until(Deadline deadline, std::int64_t n, std::stop_token stop) {
  require_positive(name_, n);
  auto& telemetry = *client_->telemetry();
  auto& cells = telemetry.cells(name_, detail::kPermitCounter);
  const auto started = SteadyClock::now();
  if (stop.stop_requested()) {
    // It never joins a line it would leave at once; counted as stopped, as a stop while waiting.
    telemetry.acquire_ended(cells, detail::kPermitCounter, name_, detail::AcquireOutcome::stopped, started, started);
    return false;
  }
  if (detail::ClientState::blocking_through_async()) {
    return client_->counter_acquire_through_async(name_, n, deadline, stop);
  }
  bool taken = false;
  try {
    taken = detail::acquire_from_counter(client_->backend(), name_, n, deadline, stop);
  } catch (const std::exception& error) {
    telemetry.acquire_ended(cells, detail::kPermitCounter, name_, detail::AcquireOutcome::failed, started,
                            SteadyClock::now(), 0, error.what());
    throw;
  }
  const auto outcome = taken                   ? detail::AcquireOutcome::admitted
                       : stop.stop_requested() ? detail::AcquireOutcome::stopped
                                               : detail::AcquireOutcome::timed_out;
  telemetry.acquire_ended(cells, detail::kPermitCounter, name_, outcome, started, SteadyClock::now());
  return taken;
}

Acquiring<bool> PermitCounter::acquire_async(std::int64_t n, AsyncOptions options) {
  require_positive(name_, n);
  return client_->counter_acquire_async(name_, n, std::move(options));
}

void PermitCounter::release(std::int64_t n) {
  require_positive(name_, n);
  client_->backend().counter_add(name_, n);
}

PermitCounter::Lockable PermitCounter::lockable(std::int64_t n) const {
  require_positive(name_, n);
  return Lockable(*this, n);
}

void PermitCounter::Lockable::require_free() const {
  if (held_) {
    throw WouldDeadlock("this Lockable view of PermitCounter '" + owner_.name_ + "' already holds its " +
                        std::to_string(n_) + " permit(s)");
  }
}

void PermitCounter::Lockable::unlock() noexcept {
  if (!held_) return;
  held_ = false;
  try {
    owner_.release(n_);
  } catch (const Error& error) {
    owner_.client_->report(error);
  }
}

}  // namespace turnstile
