// SPDX-License-Identifier: Apache-2.0
#include "wakeups/async_crowd.hpp"

#include <sys/resource.h>

#include <cstdio>
#include <utility>

namespace wakeups {

void raise_descriptor_limit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    limit.rlim_cur = limit.rlim_max;
    setrlimit(RLIMIT_NOFILE, &limit);
  }
}

using namespace std::chrono_literals;

AsyncCrowd::AsyncCrowd(std::size_t capacity) {
  leases_.resize(capacity);
  admissions_.reserve(capacity);
}

AsyncCrowd::~AsyncCrowd() {
  give_up_.request_stop();
  std::vector<std::optional<turnstile::Lease>> holds;
  {
    std::unique_lock lock(mutex_);
    if (!changed_.wait_for(lock, 120s, [&] { return ended_ == started_; }))
      std::fprintf(stderr, "AsyncCrowd: %zu of %zu acquires still pending after 120 s\n", started_ - ended_, started_);
    holds = std::move(leases_);
  }
  holds.clear();  // the holds end here, outside the lock (a release is a round trip)
}

std::size_t AsyncCrowd::add(turnstile::Mutex mutex, turnstile::Deadline deadline) {
  std::size_t index = 0;
  turnstile::Mutex* kept = nullptr;
  {
    std::lock_guard lock(mutex_);
    index = started_++;
    if (index >= leases_.size()) leases_.resize(index + 1);
    mutexes_.push_back(std::move(mutex));
    kept = &mutexes_.back();
  }
  turnstile::AsyncOptions options;
  options.deadline = deadline;
  options.stop = give_up_.get_token();
  // The callback may run at once, in this thread, when the acquire ended already.
  kept->lock_async(options).then([this, index](auto done) { ended(index, std::move(done)); });
  return index;
}

void AsyncCrowd::ended(std::size_t index, turnstile::Acquiring<std::optional<turnstile::Lease>> done) {
  std::optional<turnstile::Lease> lease;
  std::string error;
  try {
    lease = done.get();
  } catch (const std::exception& e) {
    error = "acquire " + std::to_string(index) + ": " + e.what();
  }
  std::lock_guard lock(mutex_);
  ++ended_;
  if (!error.empty()) errors_.push_back(std::move(error));
  if (lease) {
    admissions_.push_back(index);
    leases_[index] = std::move(lease);
  }
  changed_.notify_all();
}

std::size_t AsyncCrowd::admitted() {
  std::lock_guard lock(mutex_);
  return admissions_.size();
}

std::optional<std::size_t> AsyncCrowd::wait_for_admission(std::size_t k, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  if (!changed_.wait_for(lock, timeout, [&] { return admissions_.size() > k; })) return std::nullopt;
  return admissions_[k];
}

std::optional<turnstile::Lease> AsyncCrowd::take(std::size_t i) {
  std::lock_guard lock(mutex_);
  return std::exchange(leases_[i], std::nullopt);
}

std::vector<std::string> AsyncCrowd::errors() {
  std::lock_guard lock(mutex_);
  return errors_;
}

}  // namespace wakeups
