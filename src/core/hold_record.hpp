// SPDX-License-Identifier: Apache-2.0
// One backend hold plus its loss signal: what a Lease or a thread's lock hold owns, and the one
// place a hold is released (a failed release goes on in the client's background).
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <stop_token>
#include <string>

#include "core/backend.hpp"

namespace turnstile::detail {

class ClientState;

class HoldRecord {
 public:
  // Held from `held_since` (the end of its acquire's wait); its end is counted in the cells of
  // `loss` (LossSignal::cells) and told to the event hook.
  HoldRecord(std::shared_ptr<ClientState> client, std::string name, std::int64_t permits,
             std::unique_ptr<BackendHold> hold, std::shared_ptr<LossSignal> loss,
             SteadyClock::time_point held_since = SteadyClock::now());
  ~HoldRecord();  // release_without_waiting() if still held

  const std::string& name() const { return name_; }
  std::int64_t permits() const { return permits_; }
  // Made by this process, not inherited across fork() (see fork_generation.hpp).
  bool owned_by_this_process() const;
  std::uint64_t fencing_token() const { return token_; }
  std::stop_token lost_token() const { return loss_->token(); }
  HoldState hold_state() const { return loss_->observed_state(); }
  bool released() const { return hold_ == nullptr; }
  SteadyClock::time_point held_since() const { return held_since_; }
  // See BackendHold::receipt(); "" once released.
  std::string receipt() const { return hold_ ? hold_->receipt() : std::string(); }
  // Tells the holder its hold may be gone (final).
  void lose(const std::string& reason) noexcept { loss_->lose(reason); }
  std::string loss_reason() const { return loss_->reason(); }
  BackendHold& backend_hold() { return *hold_; }
  // Leaves the queue. Throws NotHeld when already released, BackendUnavailable (the release
  // then goes on in the background), HoldLost when the hold may have been lost while held.
  void release();
  // unlock()'s release: sent now (BackendHold::release_pipelined), not waited for; what
  // release() would throw goes to the error handler when the answer comes, a BackendUnavailable
  // is retried in the background. A hold already known lost is released (and reported) at once.
  void release_without_waiting() noexcept;
  // Leaves the queue `keep_for` from now (see BackendHold::release_after); a zero or negative
  // `keep_for` is release(). Throws as release(); InvalidArgument where the backend cannot keep
  // an entry (released at once then). A keep that cannot be confirmed is tried again (the same
  // write) until `keep_for` or kKeepPatience ends; then the entry is left to its own expiry, not
  // released (BackendUnavailable says so): it may end before `keep_for` only when its TTL does.
  void release_after(std::chrono::milliseconds keep_for);

 private:
  // Throws HoldLost when the hold may have been lost while held (after its release).
  void throw_if_lost_before_release() const;
  // Counts the hold's end (its hold time) and tells it: once, as the hold leaves hold_.
  void meter_end() noexcept;
  // Tries the backend's keep until it is confirmed (see release_after).
  void keep_until(SteadyClock::time_point promised_end);
  static constexpr std::chrono::milliseconds kKeepPatience{10'000};
  static constexpr std::chrono::milliseconds kKeepRetryPause{250};
  std::shared_ptr<ClientState> client_;
  std::string name_;
  std::int64_t permits_;
  std::uint64_t token_;
  std::unique_ptr<BackendHold> hold_;
  std::shared_ptr<LossSignal> loss_;
  std::uint64_t fork_generation_;
  SteadyClock::time_point held_since_;
};

// What a finished release of the hold on `name` means to its caller (release() throws it,
// unlock() reports it): nullptr when released and not lost before. `error` is what the
// backend's release threw; a BackendUnavailable hands `hold` to the client's background retries.
std::exception_ptr release_outcome(ClientState& client, const std::string& name, std::uint64_t token,
                                   const LossSignal& loss, std::shared_ptr<BackendHold> hold, std::exception_ptr error);

}  // namespace turnstile::detail
