// SPDX-License-Identifier: Apache-2.0
#include "backends/file/directory.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstring>
#include <set>
#include <vector>

#include "turnstile/error.hpp"

namespace turnstile::detail::file_state {
namespace {

std::string parent_of(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
}

std::string mode_text(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof text, "%04o", static_cast<unsigned>(mode & 07777));
  return text;
}

// Whether only this user can be in group `gid`: our own group with no other listed member.
bool private_group(gid_t gid) {
  if (gid != getegid()) return false;
  std::vector<char> buffer(16384);
  group entry{};
  group* found = nullptr;
  if (getgrgid_r(gid, &entry, buffer.data(), buffer.size(), &found) != 0 || !found) return false;
  passwd user{};
  passwd* me = nullptr;
  std::vector<char> user_buffer(16384);
  if (getpwuid_r(geteuid(), &user, user_buffer.data(), user_buffer.size(), &me) != 0 || !me) return false;
  for (char** member = found->gr_mem; *member; ++member) {
    if (std::strcmp(*member, me->pw_name) != 0) return false;
  }
  return true;
}

bool ours_or_roots(uid_t owner) { return owner == 0 || owner == geteuid(); }

void check_above(const std::string& root, const std::string& dir) {
  struct stat link {};
  if (lstat(dir.c_str(), &link) != 0) fail_io("cannot look at " + dir);
  if (S_ISLNK(link.st_mode) && !ours_or_roots(link.st_uid)) {
    throw AccessDenied("refusing " + root + ": " + dir + " above it is a symbolic link owned by uid " +
                       std::to_string(link.st_uid) + ", who could point it anywhere");
  }
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0) fail_io("cannot look at " + dir);
  if (!ours_or_roots(st.st_uid)) {
    throw AccessDenied("refusing " + root + ": " + dir + " above it belongs to uid " + std::to_string(st.st_uid) +
                       ", who could rename it away and put another in its place (this is uid " +
                       std::to_string(geteuid()) + ")");
  }
  const bool writable = (st.st_mode & S_IWOTH) || ((st.st_mode & S_IWGRP) && !private_group(st.st_gid));
  if (writable && !(st.st_mode & S_ISVTX)) {
    throw AccessDenied("refusing " + root + ": " + dir + " above it may be written by its group or others (mode " +
                       mode_text(st.st_mode) +
                       ", no sticky bit), who could rename it away and put another in its "
                       "place; chmod go-w or +t " +
                       dir + ", or use another directory");
  }
}

// `dir` and every directory above it, along the path given and along the real one (symbolic
// links among them are followed, as by any program): one that others may write to without the
// sticky bit lets them rename the backend directory (or one above it) away and put their own in
// its place, so it is refused (AccessDenied). A sticky one (/tmp) lets only owners rename.
void check_ancestors(const std::string& root, const std::string& dir) {
  std::vector<std::string> paths{dir};
  char real[PATH_MAX] = {};
  if (realpath(dir.c_str(), real) != nullptr && real != dir) paths.emplace_back(real);
  for (const auto& path : paths) {
    for (std::string at = path;; at = parent_of(at)) {
      check_above(root, at);
      if (at == "/") break;
    }
  }
}

// Creates the missing parts of `root` private to this user, but only inside a directory owned
// by this user or by root: root with a user's XDG_RUNTIME_DIR (sudo -E) must not plant a
// root-owned directory that locks the user out. The ancestors are checked before anything is
// created.
void create_missing(const std::string& root) {
  bool checked = false;
  for (std::size_t slash = 1; slash != std::string::npos;) {
    slash = root.find('/', slash + 1);
    const std::string prefix = root.substr(0, slash);
    struct stat st {};
    if (lstat(prefix.c_str(), &st) == 0) continue;
    if (errno != ENOENT) fail_io("cannot look at " + prefix);
    const std::string parent = parent_of(prefix);
    struct stat up {};
    if (stat(parent.c_str(), &up) != 0) fail_io("cannot look at " + parent);
    if (up.st_uid != geteuid() && up.st_uid != 0) {
      throw AccessDenied("refusing to create " + prefix + " inside " + parent + ", which belongs to uid " +
                         std::to_string(up.st_uid) + " (this is uid " + std::to_string(geteuid()) + ")");
    }
    if (!checked) check_ancestors(root, parent);
    checked = true;
    if (mkdir(prefix.c_str(), 0700) != 0 && errno != EEXIST) fail_io("cannot create " + prefix);
  }
}

// Whether this process is in group `gid` (its effective group or a supplementary one).
bool in_group(gid_t gid) {
  if (getegid() == gid) return true;
  const int count = getgroups(0, nullptr);
  if (count <= 0) return false;
  std::vector<gid_t> groups(static_cast<std::size_t>(count));
  const int got = getgroups(count, groups.data());
  return got > 0 && std::find(groups.begin(), groups.begin() + got, gid) != groups.begin() + got;
}

// A directory a group shares (setgid, group-writable, others kept out) that this user may not
// open is one whose group this user is not in: said so, with the way in, rather than as a bare
// "Permission denied". Returns when the directory is not such a one.
void refuse_outside_group(const std::string& root) {
  const int open_error = errno;
  struct stat st {};
  const bool shared = stat(root.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && (st.st_mode & S_ISGID) &&
                      (st.st_mode & S_IWGRP) && !(st.st_mode & S_IWOTH) && !in_group(st.st_gid);
  errno = open_error;
  if (!shared) return;
  std::vector<char> buffer(16384);
  group entry{};
  group* found = nullptr;
  const bool named = getgrgid_r(st.st_gid, &entry, buffer.data(), buffer.size(), &found) == 0 && found;
  const std::string group_name = named ? "'" + std::string(found->gr_name) + "'" : "gid " + std::to_string(st.st_gid);
  throw AccessDenied("refusing " + root + ": it is shared by group " + group_name + ", and this user (uid " +
                     std::to_string(geteuid()) + ") is not in it; a member of the group may use it (add the user " +
                     "to the group, then log in again), or use a directory of your own");
}

// Every entry of the directory is turnstile's (a state file n.* or h.*, or one being built):
// anything else means the directory is someone else's (file:///etc as root), left alone.
void check_contents(const Fd& fd, const std::string& root) {
  const int listing = openat(fd.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (listing < 0) fail_io("cannot list " + root);
  DIR* dir = fdopendir(listing);
  if (!dir) {
    close(listing);
    fail_io("cannot list " + root);
  }
  struct Close {
    DIR* dir;
    ~Close() { closedir(dir); }
  } close_dir{dir};
  while (const dirent* entry = readdir(dir)) {
    const std::string_view name = entry->d_name;
    if (name == "." || name == ".." || name.starts_with("n.") || name.starts_with("h.")) continue;
    throw AccessDenied("refusing " + root + ": it holds '" + std::string(name) +
                       "', which is not turnstile's; give turnstile a directory of its own");
  }
}

// Refuses a directory owned by someone else, or one its group or others may write to (they
// could remove or replace the state files), unless its group shares it (shared_by_group); and
// one that holds anything but turnstile's files.
void check_opened(const Fd& fd, const std::string& root) {
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) fail_io("stat " + root);
  if (!shared_by_group(st)) {
    if (st.st_uid != geteuid()) {
      throw AccessDenied("refusing " + root + ": it is owned by uid " + std::to_string(st.st_uid) +
                         ", not by this user (uid " + std::to_string(geteuid()) +
                         "; a directory a group shares is made by root, mode 2770, and its users are in its group)");
    }
    if (st.st_mode & (S_IWGRP | S_IWOTH)) {
      throw AccessDenied("refusing " + root + ": its group or others may write to it (mode " + mode_text(st.st_mode) +
                         "); make it private (chmod go-w), or, for a group to share it, chmod 2770 with others "
                         "kept out, or use another directory");
    }
  }
  check_ancestors(root, parent_of(root));
  check_contents(fd, root);
}

// State files belong in a directory of their own, never among the system's (as root, nothing
// else would stop file:///etc).
bool system_directory(const std::string& root) {
  static const std::set<std::string> directories{
      "/",         "/bin",      "/boot",      "/dev",       "/dev/shm",   "/etc", "/home",      "/lib",
      "/lib32",    "/lib64",    "/libx32",    "/media",     "/mnt",       "/opt", "/proc",      "/root",
      "/run",      "/run/lock", "/run/user",  "/sbin",      "/srv",       "/sys", "/tmp",       "/usr",
      "/usr/bin",  "/usr/lib",  "/usr/local", "/usr/sbin",  "/usr/share", "/var", "/var/cache", "/var/lib",
      "/var/lock", "/var/log",  "/var/run",   "/var/spool", "/var/tmp"};
  return directories.count(root) != 0;
}

}  // namespace

std::string root_of(const BackendUrl& url) {
  if (!url.hosts.empty() && url.hosts != std::vector<std::string>{"localhost"}) {
    throw InvalidUrl("file:// URLs name a local directory by absolute path, e.g. file:///run/turnstile; got '" +
                     url.text + "'");
  }
  if (url.path.empty() || url.path.front() != '/') {
    throw InvalidUrl("file:// URL '" + url.text + "' has no absolute directory path");
  }
  if (!url.query.empty()) {
    throw InvalidUrl("file:// URLs take no parameters; got '?" + url.query.begin()->first + "=...'");
  }
  if (!url.user.empty()) throw InvalidUrl("file:// URLs take no user name");
  // A directory is named one way only: '.' and '..' would create directories along the way.
  for (std::size_t start = 1; start < url.path.size();) {
    const auto end = std::min(url.path.find('/', start), url.path.size());
    const auto segment = url.path.substr(start, end - start);
    if (segment == "." || segment == "..") {
      throw InvalidUrl("file:// URL '" + url.text + "' has a '.' or '..' segment; give the directory's plain path");
    }
    start = end + 1;
  }
  std::string root = url.path;
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  if (system_directory(root)) {
    throw InvalidUrl("file:// URL '" + url.text + "' names the system directory " + root +
                     "; give a directory of its own, e.g. file:///run/turnstile");
  }
  return root;
}

std::optional<std::string> host_wide_problem(const char* path) {
  struct stat st {};
  if (lstat(path, &st) != 0 || !S_ISDIR(st.st_mode) || !(geteuid() == 0 || in_group(st.st_gid))) return std::nullopt;
  if (st.st_uid == 0 && shared_by_group(st)) return std::string();
  char mode[8];
  std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
  return "the host-wide directory " + std::string(path) + " is owned by uid " + std::to_string(st.st_uid) +
         " with mode " + mode + ", not as the turnstile package makes it (root's, mode 2770: setgid, writable by " +
         "its group, not by others): its users would not all share it. Fix it (systemd-tmpfiles --create, or " +
         "chown root and chmod 2770), or name another directory with --backend";
}

bool shared_by_group(const struct stat& st) {
  return S_ISDIR(st.st_mode) && (st.st_uid == 0 || st.st_uid == geteuid()) && (st.st_mode & S_ISGID) &&
         (st.st_mode & S_IWGRP) && !(st.st_mode & S_IWOTH) && (in_group(st.st_gid) || geteuid() == 0);
}

Fd open_root(const std::string& root) {
  create_missing(root);
  Fd fd(open(root.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  struct stat link {};
  if (!fd && (errno == ELOOP || errno == ENOTDIR) && lstat(root.c_str(), &link) == 0 && S_ISLNK(link.st_mode)) {
    // A symbolic link (/var/lock -> /run/lock) is followed when root or this user owns it: only
    // its owner can point it elsewhere (and the directory holding it is checked like every
    // directory above). Anyone else's is refused.
    if (!ours_or_roots(link.st_uid)) {
      throw AccessDenied("refusing " + root + ": it is a symbolic link owned by uid " + std::to_string(link.st_uid) +
                         ", who could point it anywhere (only links owned by root or this user are followed)");
    }
    fd = Fd(open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    char real[PATH_MAX] = {};
    if (fd && realpath(root.c_str(), real) != nullptr) check_ancestors(root, parent_of(real));
  }
  if (!fd) {
    if (errno == EACCES) refuse_outside_group(root);
    if (errno == ELOOP || errno == ENOTDIR) {
      throw AccessDenied("refusing " + root + ": it is a symbolic link or not a directory");
    }
    fail_io("cannot open " + root);
  }
  check_opened(fd, root);
  return fd;
}

bool shared_by_group(int root_fd) {
  struct stat st {};
  return fstat(root_fd, &st) == 0 && shared_by_group(st);
}

bool unlinked_dir(int fd) {
  struct stat st {};
  return fstat(fd, &st) != 0 || st.st_nlink == 0;
}

// ---- pins ----------------------------------------------------------------------------------

off_t DirectoryPins::byte_of(const std::string& name) {
  return static_cast<off_t>(fnv1a(name) & ((std::uint64_t{1} << 62) - 1));
}

void DirectoryPins::pin(off_t byte) {
  std::lock_guard lock(mutex_);
  if (!fd_) {
    fd_ = Fd(openat(root_fd_, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!fd_) fail_io("cannot open the backend directory");
  }
  auto& count = counts_[byte];
  if (count == 0) set_lock(fd_.get(), F_RDLCK, byte, 1, false);  // read locks never conflict: no wait
  ++count;
}

void DirectoryPins::unpin(off_t byte) {
  if (generation_ != current_generation()) return;  // a parent's pin: closed at the fork
  std::lock_guard lock(mutex_);
  auto it = counts_.find(byte);
  if (it == counts_.end()) return;
  if (--it->second == 0) {
    counts_.erase(it);
    set_lock(fd_.get(), F_UNLCK, byte, 1, false);
  }
}

}  // namespace turnstile::detail::file_state
