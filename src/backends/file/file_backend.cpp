// The embedded backend: its state files, joining, inspecting, fork (file_backend.hpp).
#include "backends/file/file_backend.hpp"

#include <algorithm>
#include <thread>

#include "backends/file/entry_slot.hpp"
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
  files_.clear();
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
  if (slot && (slot->broken() || stale(slot->probe_fd()))) {
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
    std::erase_if(files_, [&](const auto& item) { return item.second.use_count() == 1 && item.first != name; });
  }
  return result;
}

void FileBackend::forget(const std::shared_ptr<StateFile>& file) {
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
  auto file = file_to_join(request.name, try_once, CallBudget(deadline, request.stop));
  if (!file) return nullptr;  // the deadline passed or a stop came while a truncated file was in use
  auto place = std::make_unique<FilePlace>(*this, std::move(file), request);
  if (!place->join(request, try_once, first)) return nullptr;
  return place;
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
  result.mode = h.mode == Mode::lock ? "lock" : h.mode == Mode::semaphore ? "semaphore" : "";
  result.limit = h.limit;
  if (h.counter_set) result.permits = h.counter;
  std::vector<QueueEntryView> views;
  const auto host = host_name();  // every holder of a local file is on this host
  for (std::size_t i = 0; i < h.count; ++i) {
    const auto& slot = h.slots[i];
    EntryInfo info;
    info.fencing_token = slot.seq;
    info.permits = slot.permits;
    info.pid = slot.pid;
    info.host = host;
    info.label = file->label_of(slot);
    info.since = std::chrono::system_clock::time_point(
        std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::nanoseconds(slot.since_ns)));
    if (slot.kind == kCounterWaiter) {
      info.kind = "permits";
      result.waiters.push_back(info);
      continue;
    }
    info.kind = to_string(static_cast<EntryKind>(slot.kind));
    views.push_back({static_cast<EntryKind>(slot.kind), slot.permits});
    info.holding = evaluate_queue(views, views.size() - 1, h.limit).admitted();
    (info.holding ? result.holders : result.waiters).push_back(info);
  }
  file->check_intact();
  return result;
}

std::unique_ptr<Backend> make_file_backend(const BackendUrl& url, const ClientOptions& options) {
  std::string root = file_state::root_of(url);
  file_state::Fd fd = file_state::open_root(root);
  return std::make_unique<FileBackend>(std::move(root), std::move(fd), options.holder_label);
}

}  // namespace turnstile::detail
