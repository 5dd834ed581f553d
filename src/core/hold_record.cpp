// SPDX-License-Identifier: Apache-2.0
// One backend hold plus its loss signal (hold_record.hpp).
#include "core/hold_record.hpp"

#include <algorithm>
#include <thread>

#include "core/client_state.hpp"
#include "core/fork_generation.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail {

HoldRecord::HoldRecord(std::shared_ptr<ClientState> client, std::string name, std::int64_t permits,
                       std::unique_ptr<BackendHold> hold, std::shared_ptr<LossSignal> loss,
                       SteadyClock::time_point held_since)
    : client_(std::move(client)), name_(std::move(name)), permits_(permits), token_(hold->fencing_token()),
      hold_(std::move(hold)), loss_(std::move(loss)), fork_generation_(fork_generation()), held_since_(held_since) {
  loss_->set_fencing_token(token_);
}

HoldRecord::~HoldRecord() {
  if (!hold_) return;
  if (!owned_by_this_process()) {
    hold_.reset();  // the parent's hold: a child leaving never releases it
    return;
  }
  release_without_waiting();
}

bool HoldRecord::owned_by_this_process() const { return fork_generation_ == fork_generation(); }

void HoldRecord::release() {
  if (!hold_) throw NotHeld("'" + name_ + "' was already released");
  std::shared_ptr<BackendHold> hold = std::move(hold_);
  if (!owned_by_this_process()) {
    throw HoldLost("the hold on '" + name_ + "' (fencing token " + std::to_string(token_) +
                   ") was inherited across fork(): it is the parent's, and the child neither holds nor releases it");
  }
  meter_end();
  std::exception_ptr error;
  try {
    hold->release();
  } catch (const Error&) {
    error = std::current_exception();
  }
  if (auto failure = release_outcome(*client_, name_, token_, *loss_, std::move(hold), error)) {
    std::rethrow_exception(failure);
  }
}

void HoldRecord::release_without_waiting() noexcept {
  // Where release() answers without the server (nothing held, not this process's hold), the
  // hold is known lost (its HoldLost is reported now, as before) or the client waits for its
  // releases (ClientOptions::unlock_without_waiting off), it runs as it always did.
  if (!hold_ || !owned_by_this_process() || loss_->lost_by_now() || !client_->unlock_without_waiting()) {
    try {
      release();
    } catch (const Error& error) {
      client_->report(error);
    } catch (const std::exception& error) {
      client_->report(BackendUnavailable(error.what()));
    }
    return;
  }
  meter_end();
  client_->release_pipelined(name_, token_, std::move(hold_), loss_);
}

// Called only for this process's holds: an inherited one is the parent's to count.
void HoldRecord::meter_end() noexcept {
  auto* cells = loss_->cells();
  if (!cells) return;
  const auto held = std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now() - held_since_);
  cells->hold.observe(held);
  auto* telemetry = loss_->telemetry();
  if (!telemetry || !telemetry->tells_events()) return;
  try {
    auto event = Telemetry::event(EventKind::released, loss_->primitive(), name_, token_);
    event.duration = held;
    telemetry->tell(std::move(event));
  } catch (...) {
  }
}

std::exception_ptr release_outcome(ClientState& client, const std::string& name, std::uint64_t token,
                                   const LossSignal& loss, std::shared_ptr<BackendHold> hold,
                                   std::exception_ptr error) {
  const auto lost_message = [&] {
    return "hold on '" + name + "' (fencing token " + std::to_string(token) +
           ") may have been lost before its release: " + loss.reason();
  };
  try {
    if (error) std::rethrow_exception(error);
  } catch (const BackendUnavailable& failure) {
    client.retry_release_later(name, std::move(hold));
    // A hold already reported lost is reported as lost: that is what the caller must act on.
    if (loss.lost_by_now()) {
      return std::make_exception_ptr(HoldLost(lost_message() + "; its release is retried in the background"));
    }
    return std::make_exception_ptr(
        BackendUnavailable("release of '" + name + "' failed and is retried in the background: " + failure.what()));
  } catch (...) {
    return std::current_exception();
  }
  if (loss.lost_by_now()) return std::make_exception_ptr(HoldLost(lost_message()));
  return nullptr;
}

void HoldRecord::throw_if_lost_before_release() const {
  if (loss_->lost_by_now()) {
    throw HoldLost("hold on '" + name_ + "' (fencing token " + std::to_string(token_) +
                   ") may have been lost before its release: " + loss_->reason());
  }
}

void HoldRecord::release_after(std::chrono::milliseconds keep_for) {
  if (!hold_) throw NotHeld("'" + name_ + "' was already released");
  if (keep_for <= std::chrono::milliseconds::zero() || !owned_by_this_process()) return release();
  const auto promised_end = SteadyClock::now() + keep_for;
  try {
    keep_until(promised_end);
  } catch (const InvalidArgument&) {
    release();  // the backend keeps nothing: the release the caller asked for, at once
    throw;
  } catch (const BackendUnavailable& error) {
    // Whether the entry was kept is unknown. A plain release could free the name before the
    // promised end, so the entry is left to its own expiry (renewals stop): held at least as
    // long as its last renewal or the keep says, whichever the server applied.
    meter_end();
    hold_.reset();
    throw BackendUnavailable("'" + name_ + "' could not be confirmed kept after its release (" + error.what() +
                             "); it is left to expire on the server by its TTL (or by the keep, if that arrived)");
  }
  meter_end();
  hold_.reset();  // its release() now does nothing
  throw_if_lost_before_release();
}

// Each try of a backend's keep is the same write (same request, conditional on the entry still
// being ours), asked for what is left until `promised_end`: tried again, with a short pause,
// until that end or the keep's patience, whichever comes first.
void HoldRecord::keep_until(SteadyClock::time_point promised_end) {
  const auto give_up_at = std::min(promised_end, SteadyClock::now() + kKeepPatience);
  for (;;) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(promised_end - SteadyClock::now());
    try {
      if (left <= std::chrono::milliseconds::zero()) return hold_->release();  // the promised end has passed
      return hold_->release_after(left);
    } catch (const BackendUnavailable&) {
      if (SteadyClock::now() + kKeepRetryPause >= give_up_at) throw;
    }
    std::this_thread::sleep_for(kKeepRetryPause);
  }
}

void BackendHold::release_pipelined(ReleaseDone done) {
  std::exception_ptr error;
  try {
    release();
  } catch (...) {
    error = std::current_exception();
  }
  done(error);
}

void BackendHold::release_after(std::chrono::milliseconds) {
  throw InvalidArgument("this backend cannot keep a hold after its release (release_after, --hold-at-least)");
}

}  // namespace turnstile::detail
