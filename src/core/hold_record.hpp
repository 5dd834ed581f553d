// One backend hold plus its loss signal: what a Lease or a thread's lock hold owns, and the one
// place a hold is released (a failed release goes on in the client's background).
#pragma once

#include <cstdint>
#include <memory>
#include <stop_token>
#include <string>

#include "core/backend.hpp"

namespace turnstile::detail {

class ClientState;

class HoldRecord {
 public:
  HoldRecord(std::shared_ptr<ClientState> client, std::string name, std::int64_t permits,
             std::unique_ptr<BackendHold> hold, std::shared_ptr<LossSignal> loss);
  ~HoldRecord();  // releases if still held, reporting failures to the error handler

  const std::string& name() const { return name_; }
  std::int64_t permits() const { return permits_; }
  // Made by this process, not inherited across fork() (see fork_generation.hpp).
  bool owned_by_this_process() const;
  std::uint64_t fencing_token() const { return token_; }
  std::stop_token lost_token() const { return loss_->token(); }
  HoldState hold_state() const { return loss_->observed_state(); }
  bool released() const { return hold_ == nullptr; }
  // Tells the holder its hold may be gone (final).
  void lose(const std::string& reason) noexcept { loss_->lose(reason); }
  std::string loss_reason() const { return loss_->reason(); }
  BackendHold& backend_hold() { return *hold_; }
  // Leaves the queue. Throws NotHeld when already released, BackendUnavailable (the release
  // then goes on in the background), HoldLost when the hold may have been lost while held.
  void release();

 private:
  std::shared_ptr<ClientState> client_;
  std::string name_;
  std::int64_t permits_;
  std::uint64_t token_;
  std::unique_ptr<BackendHold> hold_;
  std::shared_ptr<LossSignal> loss_;
  std::uint64_t fork_generation_;
};

}  // namespace turnstile::detail
