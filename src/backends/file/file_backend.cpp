// SPDX-License-Identifier: Apache-2.0
// The embedded backend: its state files, joining, inspecting, fork (file_backend.hpp).
#include "backends/file/file_backend.hpp"

#include <algorithm>
#include <thread>

#include "backends/file/entry_slot.hpp"
#include "backends/file/values.hpp"
#include "core/backend_loader.hpp"
#include "core/host_name.hpp"

namespace turnstile::detail {

using namespace file_state;

namespace {

// A client keeps at most this many names open while nothing of theirs is held or waited for
// (each with its file and at most 2 spare descriptions): what it keeps is bounded, whatever the
// number of names it ever used.
constexpr std::size_t kIdleNames = 16;
// How often a joiner looks whether a truncated state file still in use has been let go (its
// last users are waiters that join again at once, or a holder told of the loss).
constexpr std::chrono::milliseconds kTruncatedFileRetry{10};
}  // namespace

// ---- the backend ---------------------------------------------------------------------------

FileBackend::~FileBackend() {
  unregister_for_fork(this);
  {
    // No join: waiting for the watcher to be scheduled just to see the stop costs a short
    // process (turnstile run) milliseconds on a busy machine. It exits on its own when it next
    // wakes, touching only the shared state; a check in progress uses our directory
    // descriptor, so that one we let finish.
    std::unique_lock lock(watch_->mutex);
    watch_->stop = true;
    watch_->cv.notify_all();
    // (Unless we are that check: a loss callback that dropped the last Client; or the watcher
    // is a parent's thread, which a forked child does not have.)
    if (watch_->thread != std::this_thread::get_id() && watch_->generation == current_generation()) {
      watch_->cv.wait(lock, [&] { return !watch_->checking; });
    }
  }
  close_idle_files([](const auto&) { return true; });
  files_.clear();
}

// Under files_mutex_ (or in the destructor). A name this process no longer uses has its state
// file removed when nobody else uses it either: what the directory keeps is bounded by the
// names in use, not by the names ever used (StateFile::remove_if_unused says why that is safe).
template <class Predicate>
void FileBackend::close_idle_files(Predicate closing) {
  if (generation_ != current_generation()) return;  // a forked child: the parent's files
  std::erase_if(files_, [&](const auto& item) {
    if (item.second.use_count() != 1 || !closing(item.first)) return false;  // held, waited for, or kept
    try {
      item.second->remove_if_unused();
    } catch (const std::exception&) {
      // Left in place: the next user opens it, `turnstile gc` removes it.
    }
    return true;
  });
}

// Under files_mutex_.
void FileBackend::reopen_root_if_removed() {
  if (!unlinked_dir(root_fd_.get())) return;
  Fd fresh = open_root(root_);
  removed_root_fds_.push_back(std::move(root_fd_));
  root_fd_ = std::move(fresh);
  pins_ = std::make_shared<DirectoryPins>(root_fd_.get());
}

void FileBackend::adopt_after_fork_locked() {
  if (generation_ == current_generation()) return;
  // In a forked child: the parent's files and descriptors are not ours (see the fork handlers).
  files_.clear();
  removed_root_fds_.clear();
  root_fd_ = open_root(root_);
  pins_ = std::make_shared<DirectoryPins>(root_fd_.get());
  generation_ = current_generation();
}

bool FileBackend::has_state(const std::string& name) {
  std::lock_guard lock(files_mutex_);
  adopt_after_fork_locked();
  return files_.count(name) || StateFile::exists(root_fd_.get(), name);
}

std::shared_ptr<StateFile> FileBackend::file(const std::string& name) {
  std::lock_guard lock(files_mutex_);
  adopt_after_fork_locked();
  auto& slot = files_[name];
  // A state file removed, replaced or truncated under us (rm -rf, a tmp cleaner) no longer
  // excludes anyone: use the one now at the path, never the orphan. Holds on the orphan keep it
  // alive and are told by the watcher that they may be lost.
  // The one system call of a cached name's uncontended pair besides its lock bytes (an fstat:
  // a hold in a file kept pinned needs no other look, StateFile::pin_for_hold says why).
  if (slot && (slot->broken() || slot->removed_as_unused() || slot->unlinked_or_cut())) {
    slot->stop_keeping_pin();
    slot.reset();
    reopen_root_if_removed();
  }
  if (slot) return slot;
  try {
    slot = std::make_shared<StateFile>(root_fd_.get(), pins_, name);
  } catch (...) {
    files_.erase(name);
    throw;
  }
  auto result = slot;
  if (files_.size() > kIdleNames) {
    // Close the names nobody holds or waits for (only this map refers to them).
    close_idle_files([&](const std::string& open_name) { return open_name != name; });
  }
  return result;
}

void FileBackend::forget(const std::shared_ptr<StateFile>& file) {
  file->stop_keeping_pin();
  std::lock_guard lock(files_mutex_);
  if (auto it = files_.find(file->name()); it != files_.end() && it->second == file) {
    files_.erase(it);
    reopen_root_if_removed();
  }
}

std::shared_ptr<StateFile> FileBackend::file_to_join(const std::string& name, bool try_once, const CallBudget& budget) {
  for (;;) {
    try {
      return file(name);
    } catch (const StateFileInUse&) {
      if (try_once) throw;
    }
    if (budget.passed()) return nullptr;
    std::this_thread::sleep_until(budget.until(SteadyClock::now() + kTruncatedFileRetry).deadline().value());
  }
}

std::unique_ptr<QueuePlace> FileBackend::join(const QueueRequest& request, bool try_once, Deadline deadline,
                                              Standing& first) {
  const CallBudget budget(deadline, request.stop);
  for (int removed = 0; removed <= kRemovedRetries; ++removed) {
    auto file = file_to_join(request.name, try_once, budget);
    if (!file) return nullptr;  // the deadline passed or a stop came while a truncated file was in use
    auto place = std::make_unique<FilePlace>(*this, file, request);
    switch (place->join(request, try_once, first)) {
      case FilePlace::Joined::in_queue: return place;
      case FilePlace::Joined::not_admitted: return nullptr;
      case FilePlace::Joined::file_removed: forget(file); break;
    }
  }
  throw_keeps_being_removed(request.name);
}

std::unique_ptr<CounterLine> FileBackend::counter_line(const std::string& name, std::int64_t permits,
                                                       [[maybe_unused]] const std::stop_token& stop) {
  return std::make_unique<FileCounterLine>(file(name), permits, holder_label_);
}

Inspection FileBackend::inspect(const std::string& name, Deadline) {  // local: no call to bound
  Inspection result;
  result.name = name;
  if (!has_state(name)) return result;  // looking creates nothing: no state file, nobody queued
  auto file = this->file(name);
  StateFile::Guard guard(*file);
  file->sweep_dead();
  auto& h = file->header();
  result.mode = to_string(queue_mode(h.mode));
  result.limit = h.limit;
  if (h.counter_set) result.permits = h.counter;
  std::vector<QueueEntryView> views;
  const auto host = host_name();  // every holder of a local file is on this host
  for (std::size_t i = 0; i < file->count(); ++i) {
    const auto& slot = file->slot(i);
    EntryInfo info;
    info.fencing_token = slot.seq;
    info.permits = slot.permits;
    info.pid = slot.pid;
    info.host = host;
    info.label = file->label_of(slot);
    if (slot.flags & kHasValue) info.value = read_value(*file, slot.seq);  // under the guard: whole
    info.since = std::chrono::system_clock::time_point(
        std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::nanoseconds(slot.since_ns)));
    if (slot.kind == kCounterWaiter) {
      info.kind = "permits";
      result.waiters.push_back(info);
      continue;
    }
    if (StateFile::kept(slot)) {
      const auto left = std::chrono::nanoseconds(slot.kept_until_ns - boottime_ns());
      info.kept_until =
          std::chrono::system_clock::now() + std::chrono::duration_cast<std::chrono::system_clock::duration>(left);
    }
    info.kind = to_string(static_cast<EntryKind>(slot.kind));
    views.push_back({static_cast<EntryKind>(slot.kind), slot.permits});
    info.holding = evaluate_queue(views, views.size() - 1, h.limit).admitted();
    (info.holding ? result.holders : result.waiters).push_back(info);
  }
  file->check_intact();
  return result;
}

// file:// has no session to renew and no connection: it reports nothing to `reports`.
std::unique_ptr<Backend> make_file_backend(const BackendUrl& url, const ClientOptions& options,
                                           BackendReports& /*reports*/) {
  std::string root = file_state::root_of(url);
  file_state::Fd fd = file_state::open_root(root);
  return std::make_unique<FileBackend>(std::move(root), std::move(fd), options.holder_label);
}

}  // namespace turnstile::detail
