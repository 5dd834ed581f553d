// One backend hold plus its loss signal (hold_record.hpp).
#include "core/hold_record.hpp"

#include "core/client_state.hpp"
#include "core/fork_generation.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail {

HoldRecord::HoldRecord(std::shared_ptr<ClientState> client, std::string name, std::int64_t permits,
                       std::unique_ptr<BackendHold> hold, std::shared_ptr<LossSignal> loss)
    : client_(std::move(client)), name_(std::move(name)), permits_(permits), token_(hold->fencing_token()),
      hold_(std::move(hold)), loss_(std::move(loss)), fork_generation_(fork_generation()) {
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
    throw BackendUnavailable("release of '" + name_ + "' failed and is retried in the background: " + error.what());
  }
  if (loss_->lost_by_now()) {
    throw HoldLost("hold on '" + name_ + "' (fencing token " + std::to_string(token_) +
                   ") may have been lost before its release: " + loss_->reason());
  }
}

}  // namespace turnstile::detail
