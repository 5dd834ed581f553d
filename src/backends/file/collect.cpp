// SPDX-License-Identifier: Apache-2.0
// `turnstile gc` on the embedded backend: removing the state files nobody uses (file_backend.hpp).
// A name's file is normally removed by the last process using it as it closes the name; what
// is left is the state of processes that crashed and of versions that never removed any.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <optional>

#include "backends/file/entry_slot.hpp"
#include "backends/file/file_backend.hpp"
#include "backends/file/state_names.hpp"
#include "backends/file/values.hpp"
#include "core/text_escape.hpp"

namespace turnstile::detail {

using namespace file_state;

namespace {

// A file being built aside (n.<name>.tmp.<pid>.<random>) lives for a few system calls; one
// older than this was left by a process killed while creating a state file.
constexpr std::chrono::seconds kLeftoverTempAge{60};

// Removes a temporary file a process killed while creating a state file left behind.
bool remove_leftover_temp(int root_fd, const std::string& file_name) {
  struct stat st {};
  if (fstatat(root_fd, file_name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) return false;
  const auto age = std::chrono::system_clock::now() - std::chrono::system_clock::from_time_t(st.st_mtime);
  return age > kLeftoverTempAge && unlinkat(root_fd, file_name.c_str(), 0) == 0;
}

}  // namespace

std::vector<std::string> FileBackend::collect_unused(const std::string& prefix) {
  std::lock_guard lock(files_mutex_);
  adopt_after_fork_locked();
  reopen_root_if_removed();
  std::vector<std::string> removed;
  for (const auto& file_name : state_directory_entries(root_fd_.get())) {
    if (file_name.find(".tmp.") != std::string::npos) {
      if (remove_leftover_temp(root_fd_.get(), file_name))
        removed.push_back("(unfinished state file " + file_name + ")");
      continue;
    }
    if (remove_value_if_orphan(file_name, prefix)) {
      removed.push_back("(leader value of a gone entry " + file_name + ")");
      continue;
    }
    const auto name = name_of_state_file(root_fd_.get(), file_name, Versions::any);
    if (!name || !name->starts_with(prefix)) continue;
    if (remove_state_if_unused(*name)) removed.push_back(*name);
  }
  std::sort(removed.begin(), removed.end());
  return removed;
}

// Under files_mutex_. A value file (values.hpp) is an orphan when no slot refers to it: a
// process was killed between placing it and appending its slot, or between removing the two.
// Values are renamed into place only under the state file's guard, so under it the slots say
// whether one is in use. Without a state file, only one older than a creator's few system
// calls is taken (a creator makes the state file before it places a value).
bool FileBackend::remove_value_if_orphan(const std::string& file_name, const std::string& prefix) {
  std::string state_file_name;
  std::uint64_t seq = 0;
  if (!parse_value_file(file_name, state_file_name, seq)) return false;
  // Whose it is: an n.* file's name is in its file name, an h.* file's only in its state file.
  const auto name = name_of_state_file(root_fd_.get(), state_file_name, Versions::any);
  if (name ? !name->starts_with(prefix) : !prefix.empty()) return false;
  struct stat st {};
  if (fstatat(root_fd_.get(), state_file_name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    return remove_leftover_temp(root_fd_.get(), file_name);
  }
  if (!name) return false;
  try {
    auto file = files_.count(*name) ? files_[*name] : std::make_shared<StateFile>(root_fd_.get(), pins_, *name);
    StateFile::Guard guard(*file);
    if (file->broken() || !file->at_its_path() || file->find(seq) >= 0) return false;
    return unlinkat(root_fd_.get(), file_name.c_str(), 0) == 0;
  } catch (const std::exception&) {
    return false;
  }
}

// Under files_mutex_. Opening the name's file (as any user would) replaces one from an earlier
// boot; one an older version wrote in this boot, or that is not turnstile's, is refused and
// kept (a process of that version may be using it and knows nothing of removal).
bool FileBackend::remove_state_if_unused(const std::string& name) {
  std::shared_ptr<StateFile> file;
  if (auto it = files_.find(name); it != files_.end()) {
    if (it->second.use_count() != 1) return false;  // held or waited for here
    file = std::move(it->second);
    files_.erase(it);
    if (file->broken() || !file->at_its_path()) file.reset();  // no longer the one at its path
  }
  try {
    if (!file) file = std::make_shared<StateFile>(root_fd_.get(), pins_, name);
    return file->remove_if_unused();
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace turnstile::detail
