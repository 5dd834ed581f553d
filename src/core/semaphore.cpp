// SPDX-License-Identifier: Apache-2.0
#include "turnstile/semaphore.hpp"
#include "core/client_state.hpp"

namespace turnstile {

Lease::Lease(std::shared_ptr<detail::HoldRecord> record) : record_(std::move(record)) {}
Lease::Lease(Lease&& other) noexcept = default;

Lease& Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    record_.reset();  // the record's destructor releases, reporting failures
    record_ = std::move(other.record_);
  }
  return *this;
}

Lease::~Lease() = default;

namespace {
const detail::HoldRecord& require(const std::shared_ptr<detail::HoldRecord>& record) {
  if (!record) throw NotHeld("this Lease holds nothing (released or moved from)");
  return *record;
}
}  // namespace

const std::string& Lease::name() const { return require(record_).name(); }
std::int64_t Lease::permits() const { return require(record_).permits(); }
std::uint64_t Lease::fencing_token() const { return require(record_).fencing_token(); }
std::string Lease::release_receipt() const { return require(record_).receipt(); }
std::stop_token Lease::lost_token() const { return require(record_).lost_token(); }
HoldState Lease::hold_state() const { return require(record_).hold_state(); }

void Lease::release() {
  require(record_);
  auto record = std::move(record_);
  if (record.use_count() > 1) return;  // a nested hold of a reentrant lock object: the last one leaves
  record->release();
}

void Lease::release_after(std::chrono::milliseconds keep_for) {
  require(record_);
  auto record = std::move(record_);
  if (record.use_count() > 1) return;
  record->release_after(keep_for);
}

Semaphore::Semaphore(std::shared_ptr<detail::ClientState> client, std::string name, std::int64_t limit)
    : client_(std::move(client)), name_(std::move(name)), limit_(limit) {}

void Semaphore::require_count(std::int64_t n) const {
  if (n <= 0 || n > limit_) {
    throw InvalidArgument("Semaphore '" + name_ + "': cannot acquire " + std::to_string(n) +
                          " leases, the count must be between 1 and the limit " + std::to_string(limit_));
  }
}

std::optional<Lease> Semaphore::acquire_until(Deadline deadline, std::int64_t n, std::stop_token stop) {
  require_count(n);
  auto record = client_->acquire({.name = name_,
                                  .kind = detail::EntryKind::lease,
                                  .permits = n,
                                  .limit = limit_,
                                  .primitive = detail::Primitive::semaphore,
                                  .stop = std::move(stop)},
                                 deadline);
  if (!record) return std::nullopt;
  return Lease(std::shared_ptr<detail::HoldRecord>(std::move(record)));
}

Acquiring<std::optional<Lease>> Semaphore::acquire_async(std::int64_t n, AsyncOptions options) {
  require_count(n);
  return client_->acquire_async({.name = name_,
                                 .kind = detail::EntryKind::lease,
                                 .permits = n,
                                 .limit = limit_,
                                 .primitive = detail::Primitive::semaphore},
                                std::move(options));
}

Semaphore::Lockable Semaphore::lockable(std::int64_t n) const {
  if (n <= 0 || n > limit_) {
    throw InvalidArgument("Semaphore '" + name_ + "': a lockable view needs between 1 and " + std::to_string(limit_) +
                          " leases, got " + std::to_string(n));
  }
  return Lockable(*this, n);
}

}  // namespace turnstile
