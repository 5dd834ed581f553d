// SPDX-License-Identifier: Apache-2.0
#include "conformance/late_support.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>

namespace conformance {
namespace {

bool starts_with(const std::string& text, const char* prefix) { return text.rfind(prefix, 0) == 0; }

}  // namespace

LatePatterns late_patterns(const std::string& url, const std::string& label, const std::string& counter) {
  LatePatterns patterns;
  if (starts_with(url, "redis")) {
    // acquire.lua and counter_acquire.lua get the holder label as an argument; counter_add.lua
    // the counter's keys (the first request naming the counter once the add starts).
    patterns = {label, 1, label, 1, label, 1, label, 1, counter, 1, true};
  } else if (starts_with(url, "etcd")) {
    // gRPC DATA frames are plain protobuf: a join's entry value (a lease's, a waiter's in a
    // counter's line) ends with the label; a take puts its request marker with the value
    // "taken" (a PutRequest's value, field 2: bytes 0x12, length 5; the leave that settles a
    // take only compares that value, field 7 of a Compare); an add reads the counter key and
    // then writes it with a compare on its revision (the second request naming it).
    patterns = {label,
                1,
                label,
                1,
                label,
                1,
                std::string("\x12\x05"
                            "taken"),
                1,
                "\x1fturnstile/permits/" + counter,
                2,
                false};
  } else if (starts_with(url, "zk") || starts_with(url, "zookeeper")) {
    // An entry's node (a waiter's in a counter's line too) has data ending with
    // " label=<label>". A counter's requests all name its path: holding the first holds the rest
    // of the session's connection with it.
    const auto data = " label=" + label;
    patterns = {data, 1, data, 1, data, 1, counter, 1, counter, 1, false, true};
  } else if (starts_with(url, "consul")) {
    // Every write of a join, take or counter change is one transaction (an uncontended
    // Semaphore's second: the join's, then the take that holds its lease); the reads before are
    // GETs, the session's renewals other PUTs. A place in a counter's line is a key under the
    // line's prefix turnstile/cq/<name>/ (the test's plain names are their own keys): the look
    // before it reads the prefix (GET …/cq/<name>/?recurse, the first request naming it), the
    // join then writes <prefix><session>-<n>, in a transaction's body ("Key":"turnstile/cq/…")
    // or, before issue 22, in the path of a PUT ?acquire: the second names it either way.
    const auto line = "turnstile/cq/" + counter + "/";
    patterns = {"PUT /v1/txn", 1, "PUT /v1/txn", 2, line, 2, "PUT /v1/txn", 1, "PUT /v1/txn", 1, true};
  }
  return patterns;
}

std::string late_value_pattern(const std::string& url, const std::string& value) {
  if (!starts_with(url, "consul")) return value;
  static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string encoded;
  for (std::size_t at = 0; at < value.size(); at += 3) {
    std::uint32_t group = 0;
    const auto bytes = std::min<std::size_t>(3, value.size() - at);
    for (std::size_t i = 0; i < 3; ++i) {
      group = group << 8 | (i < bytes ? static_cast<unsigned char>(value[at + i]) : 0u);
    }
    for (std::size_t i = 0; i < 4; ++i) encoded += i <= bytes ? kAlphabet[group >> (18 - 6 * i) & 63] : '=';
  }
  return encoded;
}

std::string late_skip_reason(const std::string& url) {
  if (starts_with(url, "file:")) return "file:// has no server for a request to reach late";
  if (starts_with(url, "redis+sentinel:") || starts_with(url, "redis+cluster:")) {
    return "the proxy would stand between the client and the sentinels or one cluster node, not the nodes serving "
           "the names (the redis family covers the scripts they share)";
  }
  return "";
}

LateRig::LateRig(const std::string& url, turnstile::ClientOptions options) {
  const int count = starts_with(url, "etcd") ? 2 : 1;
  for (int i = 0; i < count; ++i) proxies_.push_back(std::make_unique<turnstile_test::TcpProxy>(url));
  auto through = proxies_.front()->url_through(url);
  if (count == 2) {
    // Both proxies in the host list: "…://127.0.0.1:A/…" becomes "…://127.0.0.1:A,127.0.0.1:B/…".
    const auto first = "127.0.0.1:" + std::to_string(proxies_[0]->port());
    through.replace(through.find(first), first.size(), first + ",127.0.0.1:" + std::to_string(proxies_[1]->port()));
  }
  client_.emplace(turnstile::Client::connect(through, std::move(options)));
}

std::uint64_t LateRig::accepted() const {
  std::uint64_t sum = 0;
  for (const auto& proxy : proxies_) sum += proxy->accepted();
  return sum;
}

LateRig::Hold LateRig::hold(const std::string& pattern, int nth) {
  Hold hold;
  for (auto& proxy : proxies_) hold.armed_.push_back(proxy->hold_request(pattern, nth));
  return hold;
}

bool LateRig::Hold::wait_held(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!caught_) {
    for (auto& held : armed_) {
      if (!caught_ && held->held()) caught_ = held;
    }
    if (caught_) break;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // The others must not catch the client's resend: disarmed (or, caught too, let go).
  for (auto& held : armed_) {
    if (held != caught_) held->deliver();
  }
  return true;
}

void LateRig::Hold::cut_client() {
  if (caught_) caught_->cut_client();
}

void LateRig::Hold::deliver() {
  if (caught_) caught_->deliver();
}

LateRig::Copy LateRig::duplicate(const std::string& pattern, int nth) {
  Copy copy;
  for (auto& proxy : proxies_) copy.armed_.push_back(proxy->duplicate_request(pattern, nth));
  return copy;
}

bool LateRig::Copy::wait_seen(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    for (auto& copy : armed_) {
      if (copy->wait_seen(std::chrono::milliseconds(0))) seen_ = copy;
    }
    if (seen_) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void LateRig::Copy::replay() {
  if (seen_) seen_->replay();
}

std::future<Outcome> attempt(std::function<bool()> call) {
  return std::async(std::launch::async, [call = std::move(call)] {
    Outcome outcome;
    try {
      outcome.succeeded = call();
    } catch (const turnstile::Error& error) {
      outcome.error = error.what();
    }
    return outcome;
  });
}

bool shows_within(const std::function<bool()>& seen, std::chrono::milliseconds window) {
  const auto deadline = std::chrono::steady_clock::now() + window;
  for (;;) {
    if (seen()) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

std::string unique_label() {
  static std::atomic<int> calls{0};
  return "late-" + std::to_string(getpid()) + "-" + std::to_string(++calls);
}

}  // namespace conformance
