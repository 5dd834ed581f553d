// SPDX-License-Identifier: Apache-2.0
#include "queue_messages.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "common.hpp"

namespace turnstile::cli {

namespace {

// One holder as messages name it: its label, pid@host and since when, or the foreign client.
std::string holder_text(const EntryInfo& holder) {
  if (!holder.foreign.empty()) return printable(holder.foreign);
  std::string text;
  if (!holder.label.empty()) text += "\"" + printable(holder.label) + "\" ";
  // What a backend does not know (pid 0, the epoch) is left out rather than made up.
  if (holder.pid != 0) {
    text += "pid " + std::to_string(holder.pid) + "@" + printable(holder.host);
  } else if (!holder.host.empty()) {
    text += printable(holder.host);
  } else if (holder.label.empty()) {
    text += "an unidentified holder";
  }
  if (holder.since.time_since_epoch().count() != 0) text += " since " + iso8601(holder.since);
  // --hold-at-least: its run may be over, and the name is still held until then.
  if (holder.kept_until) text += ", kept until " + iso8601(*holder.kept_until);
  while (text.ends_with(' ')) text.pop_back();
  return text;
}

// A look for messages only: it never holds turnstile up for long, whatever the server does (a
// look the server does not answer in time just names nobody).
constexpr auto kLookPatience = std::chrono::milliseconds(500);

}  // namespace

QueueView look_at_queue(Client& client, const std::string& name) {
  try {
    const auto inspection = client.inspect(name, SteadyClock::now() + kLookPatience);
    QueueView view{true, {}, inspection.holders.size(), inspection.waiters.size()};
    if (!inspection.holders.empty()) view.holder = holder_text(inspection.holders.front());
    const auto ours = [self = static_cast<std::int64_t>(getpid())](const EntryInfo& entry) {
      return entry.pid == self;
    };
    view.has_ours = std::any_of(inspection.holders.begin(), inspection.holders.end(), ours) ||
                    std::any_of(inspection.waiters.begin(), inspection.waiters.end(), ours);
    return view;
  } catch (const Error&) {
    return {};
  }
}

std::string give_back_after_signal(Client& client, const std::string& name, std::optional<Hold>& hold) {
  const auto unconfirmed = " (it may not have finished: an entry left behind ends with this client's session or TTL)";
  if (hold) {
    try {
      hold->release();
      return "released '" + name + "'";
    } catch (const Error& error) {
      return "could not confirm the release of '" + name + "': " + error.what() + unconfirmed;  // nothing ran under it
    }
  }
  const auto queue = look_at_queue(client, name);
  if (queue.known && !queue.has_ours) return "left the queue of '" + name + "'";
  return "could not confirm leaving the queue of '" + name + "'" + unconfirmed;
}

std::string held_by(const QueueView& view) {
  if (view.holder.empty()) return {};
  std::string text = "; held by " + view.holder;
  if (view.holders > 1) text += " (and " + std::to_string(view.holders - 1) + " more)";
  return text;
}

std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", seconds);
  return text;
}

}  // namespace turnstile::cli
