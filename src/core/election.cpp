// SPDX-License-Identifier: Apache-2.0
// Election and LeaderObserver (turnstile/election.hpp): a candidate is an exclusive queue entry
// with a value, leadership is its hold (a HoldRecord, as a Lease's), the leader is the queue's
// admitted head as inspect reads it.
#include "turnstile/election.hpp"

#include <algorithm>
#include <condition_variable>
#include <mutex>

#include "core/client_state.hpp"

namespace turnstile::detail {

// What an Election object and its copies in flight (an async campaign's sink) share.
class ElectionState {
 public:
  ElectionState(std::shared_ptr<ClientState> client, std::string name)
      : client_(std::move(client)), name_(std::move(name)) {}

  ClientState& client() const { return *client_; }
  const std::shared_ptr<ClientState>& client_handle() const { return client_; }
  const std::string& name() const { return name_; }

  // The request of a new campaign, which this object may start: throws InvalidArgument (the
  // value) and WouldDeadlock (a candidate or leader already). Returns the campaign's number.
  std::uint64_t begin_campaign(std::string_view value, QueueRequest& request) {
    check_value(value);
    std::lock_guard lock(mutex_);
    if (campaigning_ || (record_ && !record_->released())) {
      throw WouldDeadlock("this Election object is a candidate for '" + name_ +
                          "' or leads it already; resign first (two candidates need two Election objects)");
    }
    campaigning_ = true;
    pending_.reset();
    request = QueueRequest{
        .name = name_, .kind = EntryKind::exclusive, .primitive = Primitive::election, .value = std::string(value)};
    return ++campaign_;
  }
  void set_pending(std::weak_ptr<AsyncOperation> pending) {
    std::lock_guard lock(mutex_);
    pending_ = std::move(pending);
  }
  // The campaign numbered `campaign` ended with `record` (nullptr: not admitted). True when this
  // object leads now; a record that comes after a resign (or a newer campaign) is released.
  bool end_campaign(std::uint64_t campaign, std::unique_ptr<HoldRecord> record) {
    std::unique_lock lock(mutex_);
    if (campaign != campaign_) return false;  // `record`'s end releases it, outside the lock
    campaigning_ = false;
    if (!record) return false;
    record_ = std::move(record);
    return true;
  }
  // Takes what resign() gives up: the leadership, and the campaign in flight (cancelled).
  std::shared_ptr<HoldRecord> take_for_resign() {
    std::shared_ptr<AsyncOperation> pending;
    std::shared_ptr<HoldRecord> record;
    {
      std::lock_guard lock(mutex_);
      ++campaign_;  // a campaign still in flight ends without leading
      campaigning_ = false;
      pending = pending_.lock();
      pending_.reset();
      record = std::move(record_);
    }
    if (pending) pending->cancel();
    return record;
  }
  // The leadership, or nullptr.
  std::shared_ptr<HoldRecord> leading() const {
    std::lock_guard lock(mutex_);
    return record_ && !record_->released() ? record_ : nullptr;
  }
  // The leadership; NotHeld when this object does not lead.
  std::shared_ptr<HoldRecord> require_leading() const {
    auto record = leading();
    if (!record) throw NotHeld("this Election object does not lead '" + name_ + "'");
    return record;
  }

  static void check_value(std::string_view value) {
    if (value.size() > max_election_value) {
      throw InvalidArgument("a leader value is at most " + std::to_string(max_election_value) +
                            " bytes, this one has " + std::to_string(value.size()));
    }
  }

 private:
  std::shared_ptr<ClientState> client_;
  std::string name_;
  mutable std::mutex mutex_;
  std::shared_ptr<HoldRecord> record_;     // the leadership (released by its end)
  bool campaigning_ = false;               // a campaign is in flight
  std::uint64_t campaign_ = 0;             // the latest campaign's number (a resign counts too)
  std::weak_ptr<AsyncOperation> pending_;  // the async campaign in flight
};

namespace {

// The leader `inspection` shows: its admitted head, when the queue is an election.
std::optional<Leader> leader_of(const Inspection& inspection) {
  if (inspection.mode.empty() || inspection.holders.empty()) return std::nullopt;
  if (inspection.mode != "election") {
    throw KindMismatch("'" + inspection.name + "' is in use as a " + inspection.mode + ", not as an election");
  }
  const auto& head = inspection.holders.front();
  Leader leader{.value = head.value, .fencing_token = head.fencing_token};
  if (head.since != std::chrono::system_clock::time_point()) leader.since = head.since;
  return leader;
}

std::optional<Leader> read_leader(ClientState& client, const std::string& name, SteadyClock::time_point deadline) {
  return leader_of(client.backend().inspect(name, deadline));
}

bool same_leader(const std::optional<Leader>& a, const std::optional<Leader>& b) {
  if (!a || !b) return !a && !b;
  return a->fencing_token == b->fencing_token && a->value == b->value;
}

// The default LeaderWatch: sleeps one poll period (or until the deadline or a stop).
class PollingLeaderWatch final : public LeaderWatch {
 public:
  void wait(Deadline deadline, const std::stop_token& stop) override {
    auto until = SteadyClock::now() + Backend::kLeaderPoll;
    if (deadline) until = std::min(until, *deadline);
    std::mutex mutex;
    std::condition_variable_any never;
    std::unique_lock lock(mutex);
    never.wait_until(lock, stop, until, [] { return false; });
  }
};

// A read of the leader answers within this, however far the observer's deadline is.
constexpr std::chrono::seconds kLeaderRead{5};

}  // namespace

std::unique_ptr<LeaderWatch> Backend::watch_leader(const std::string&) {
  return std::make_unique<PollingLeaderWatch>();
}

void BackendHold::proclaim(const std::string&) {
  throw InvalidArgument("this backend has no election layout: a leader's value cannot be changed (proclaim)");
}

}  // namespace turnstile::detail

namespace turnstile {

Election::Election(std::shared_ptr<detail::ClientState> client, std::string name)
    : state_(std::make_shared<detail::ElectionState>(std::move(client), std::move(name))) {}
Election::Election(Election&&) noexcept = default;

Election& Election::operator=(Election&& other) noexcept {
  if (this != &other) {
    if (state_) static_cast<void>(state_->take_for_resign());  // its end releases, reporting failures
    state_ = std::move(other.state_);
  }
  return *this;
}

Election::~Election() {
  if (state_) static_cast<void>(state_->take_for_resign());
}

const std::string& Election::name() const { return state_->name(); }

bool Election::campaign_until(std::string_view value, Deadline deadline, std::stop_token stop) {
  detail::QueueRequest request;
  const auto campaign = state_->begin_campaign(value, request);
  request.stop = std::move(stop);
  std::unique_ptr<detail::HoldRecord> record;
  try {
    record = state_->client().acquire(request, deadline);
  } catch (...) {
    state_->end_campaign(campaign, nullptr);
    throw;
  }
  return state_->end_campaign(campaign, std::move(record));
}

Acquiring<bool> Election::campaign_async(std::string value, AsyncOptions options) {
  detail::QueueRequest request;
  const auto campaign = state_->begin_campaign(value, request);
  auto result = std::make_shared<detail::AsyncState<bool>>();
  Acquiring<bool> handle(result);
  auto& client = state_->client();
  // The sink keeps no Election alive: a leadership won after the object ended is released.
  auto sink = [election = std::weak_ptr<detail::ElectionState>(state_), campaign, result](
                  std::unique_ptr<detail::HoldRecord> record, std::exception_ptr error) {
    auto state = election.lock();
    bool leads = false;
    if (state) leads = state->end_campaign(campaign, std::move(record));
    record.reset();  // not kept: released here, before the result is told
    if (error) return result->fail(std::move(error));
    result->complete(leads);
  };
  try {
    auto operation = client.start_record_async(std::move(request), options, std::move(sink));
    result->set_operation(operation);
    state_->set_pending(operation);
  } catch (...) {
    state_->end_campaign(campaign, nullptr);
    throw;
  }
  return handle;
}

void Election::resign() {
  if (auto record = state_->take_for_resign()) {
    if (record.use_count() == 1) record->release();
  }
}

void Election::proclaim(std::string_view value) {
  detail::ElectionState::check_value(value);
  auto record = state_->require_leading();
  if (record->hold_state() == HoldState::lost) {
    throw HoldLost("the leadership of '" + name() + "' (fencing token " + std::to_string(record->fencing_token()) +
                   ") may have been lost (" + record->loss_reason() + "); nothing was proclaimed");
  }
  record->backend_hold().proclaim(std::string(value));
}

bool Election::is_leader() const {
  auto record = state_->leading();
  return record && record->hold_state() == HoldState::held;
}

HoldState Election::hold_state() const { return state_->require_leading()->hold_state(); }
std::stop_token Election::lost_token() const { return state_->require_leading()->lost_token(); }
std::uint64_t Election::fencing_token() const { return state_->require_leading()->fencing_token(); }
std::string Election::release_receipt() const { return state_->require_leading()->receipt(); }

std::optional<Leader> Election::leader(std::chrono::milliseconds timeout) const {
  auto leader = detail::read_leader(state_->client(), name(), SteadyClock::now() + timeout);
  if (leader) {
    const auto ours = state_->leading();
    leader->ours = ours && ours->fencing_token() == leader->fencing_token;
  }
  return leader;
}

LeaderObserver Election::observe() const { return LeaderObserver(state_->client_handle(), name()); }

LeaderObserver::LeaderObserver(std::shared_ptr<detail::ClientState> client, std::string name)
    : client_(std::move(client)), name_(std::move(name)) {}
LeaderObserver::LeaderObserver(LeaderObserver&&) noexcept = default;
LeaderObserver& LeaderObserver::operator=(LeaderObserver&&) noexcept = default;
LeaderObserver::~LeaderObserver() = default;

std::optional<std::optional<Leader>> LeaderObserver::next(Deadline deadline, std::stop_token stop) {
  if (!watch_) watch_ = client_->backend().watch_leader(name_);
  for (;;) {
    if (stop.stop_requested()) return std::nullopt;
    auto read_by = SteadyClock::now() + detail::kLeaderRead;
    if (deadline) read_by = std::max(std::min(read_by, *deadline), SteadyClock::now());
    std::optional<Leader> now;
    try {
      now = detail::read_leader(*client_, name_, read_by);
    } catch (const BackendUnavailable&) {
      // A wake just before the deadline leaves the read no time (Consul refuses a call then):
      // the deadline passed with nothing new seen, as when the wait itself runs out.
      if (reported_ && deadline && SteadyClock::now() >= *deadline) return std::nullopt;
      throw;
    }
    if (!reported_ || !detail::same_leader(last_, now)) {
      reported_ = true;
      last_ = now;
      return std::optional<std::optional<Leader>>(std::move(now));
    }
    if (deadline && SteadyClock::now() >= *deadline) return std::nullopt;
    watch_->wait(deadline, stop);
    // A read now would have no time left (etcd refuses a call past its deadline at once).
    if (deadline && SteadyClock::now() >= *deadline) return std::nullopt;
  }
}

Election Client::election(std::string_view name) {
  detail::validate_name(name);
  if (!state_->backend().has_elections()) {
    const auto& url = state_->url();
    const auto scheme = url.substr(0, url.find(':'));
    throw InvalidArgument(
        "leader election is not available on the " + scheme +
        ":// backend yet (docs/guide.md \"Leader election\" lists the backends that have it): no election on '" +
        std::string(name) + "'");
  }
  return Election(state_, std::string(name));
}

}  // namespace turnstile
