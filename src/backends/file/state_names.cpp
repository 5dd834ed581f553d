// SPDX-License-Identifier: Apache-2.0
// The names whose state files a backend directory holds, for Client::names_in_use: read from the
// directory and, for long names (h.<hash>.….s), from the name each file stores. Opens nothing
// for writing and creates nothing.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <optional>

#include "backends/file/state_names.hpp"

#include "backends/file/file_backend.hpp"
#include "backends/file/state.hpp"
#include "core/text_escape.hpp"

namespace turnstile::detail::file_state {
namespace {

// The name a state file stores, when it is a state file of this version: an older version's
// file (refused by inspect until it is removed), or one being created, names nothing a listing
// could inspect, and must not make the whole listing fail.
std::optional<std::string> stored_name(int root_fd, const char* file_name) {
  Fd fd(openat(root_fd, file_name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK));
  struct stat st {};
  if (!fd || fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
  std::uint32_t magic_and_version[2]{};
  std::uint32_t length = 0;
  char name[kMaxName];
  if (pread(fd.get(), magic_and_version, sizeof magic_and_version, offsetof(Header, magic)) !=
          sizeof magic_and_version ||
      magic_and_version[0] != kMagic || magic_and_version[1] != kVersion ||
      pread(fd.get(), &length, sizeof length, offsetof(Header, name_length)) != sizeof length || length == 0 ||
      length > kMaxName || pread(fd.get(), name, length, offsetof(Header, name)) != static_cast<ssize_t>(length)) {
    return std::nullopt;
  }
  return std::string(name, length);
}

}  // namespace

std::vector<std::string> state_directory_entries(int root_fd) {
  const int listing = openat(root_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (listing < 0) fail_io("cannot read the backend directory");
  DIR* dir = fdopendir(listing);
  if (!dir) {
    close(listing);
    fail_io("cannot read the backend directory");
  }
  std::vector<std::string> entries;
  while (const dirent* entry = readdir(dir)) {
    const std::string_view name = entry->d_name;
    if (name.starts_with("n.") || name.starts_with("h.")) entries.emplace_back(name);
  }
  closedir(dir);
  return entries;
}

std::optional<std::string> name_of_state_file(int root_fd, std::string_view file_name, Versions versions) {
  if (!file_name.ends_with(".s") || !(file_name.starts_with("n.") || file_name.starts_with("h."))) {
    return std::nullopt;
  }
  const auto named = percent_decode(file_name.substr(2, file_name.size() - 4));  // no "n." or ".s"
  if (file_name.starts_with("n.") && versions == Versions::any) return named;
  const auto stored = stored_name(root_fd, std::string(file_name).c_str());
  if (!stored || file_name.starts_with("h.")) return stored;
  // A short name's file names it by its file name; the stored copy must agree (else it is not
  // a state file of ours to list).
  return named == stored ? stored : std::nullopt;
}

}  // namespace turnstile::detail::file_state

namespace turnstile::detail {

QueueNames FileBackend::queue_names(const std::string& prefix, std::size_t max_names, Deadline) {
  Fd root;
  {
    std::lock_guard lock(files_mutex_);
    adopt_after_fork_locked();
    root = Fd(openat(root_fd_.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  }
  if (!root) file_state::fail_io("cannot read the directory " + root_);
  QueueNames result;
  for (const auto& file_name : file_state::state_directory_entries(root.get())) {
    auto name = file_state::name_of_state_file(root.get(), file_name, file_state::Versions::current);
    if (!name || !name->starts_with(prefix)) continue;
    if (!result.add(std::move(*name), max_names)) break;
  }
  return result;
}

}  // namespace turnstile::detail
