// SPDX-License-Identifier: Apache-2.0
// The backend directory: which one a URL names, the checks before it is used (ownership, modes,
// the directories above it), and the pins on it that outlive the state files in it.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstddef>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "backends/file/os.hpp"
#include "core/url.hpp"

namespace turnstile::detail::file_state {

// The directory a file:// URL names, or InvalidUrl (a host, parameters, '.' or '..', a system
// directory).
std::string root_of(const BackendUrl& url);

// Opens the backend directory, creating missing parts private to this user (see directory.cpp).
// Refusals are AccessDenied.
Fd open_root(const std::string& root);

// A directory a group shares: made by root (or this user), setgid so that every file made in
// it belongs to its group, writable by that group and not by others (e.g. mode 2770, group
// ops), and this process is in that group. Its state files are made group-writable (0660) and
// those of the group's other users are accepted.
bool shared_by_group(const struct stat& directory);
bool shared_by_group(int root_fd);

// The host-wide directory at `path` (Client::host_wide_directory) as this process would use it:
// nullopt when it is not this process's to use (missing, not a directory, or this process is
// neither root nor in its group); "" when it is as the Debian package makes it (root's, setgid,
// writable by its group and not by others); else what is wrong with it. Root and the group's
// members must then be refused, not given their private defaults: that would split the
// namespace they share without a word.
std::optional<std::string> host_wide_problem(const char* path);

// Whether the directory we hold open was removed from the tree.
bool unlinked_dir(int fd);

// Read locks on bytes of the backend directory itself, which outlives every state file in it:
// one byte per name (a hash of it), held by a process for as long as it holds anything of that
// name. A state file that is missing is created afresh only while nobody pins its name, so a
// held state file removed or moved away (rm, a tmp cleaner) lets nobody else in while its
// holder lives, whether or not it has noticed yet. All holds of a client in one directory share
// one description of it and count per byte; probes use the directory's main descriptor, which
// never holds OFD locks, so they see this process's pins too.
class DirectoryPins {
 public:
  explicit DirectoryPins(int root_fd) : root_fd_(root_fd) {}
  DirectoryPins(const DirectoryPins&) = delete;
  DirectoryPins& operator=(const DirectoryPins&) = delete;

  static off_t byte_of(const std::string& name);
  void pin(off_t byte);
  void unpin(off_t byte);
  bool pinned(off_t byte) const { return is_locked(root_fd_, byte, 1); }

 private:
  int root_fd_;
  Fd fd_;
  std::uint64_t generation_ = current_generation();
  std::mutex mutex_;
  std::unordered_map<off_t, std::size_t> counts_;
};

}  // namespace turnstile::detail::file_state
