// SPDX-License-Identifier: Apache-2.0
// Election candidates' value files (values.hpp).
#include "backends/file/values.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <charconv>

#include "backends/file/directory.hpp"
#include "turnstile/election.hpp"

namespace turnstile::detail::file_state {
namespace {

// Distinct temporary names within this process (with the pid: across processes).
std::atomic<std::uint64_t> drafts{0};

void write_all(int fd, const std::string& value, const std::string& name) {
  std::size_t done = 0;
  while (done < value.size()) {
    const auto n = write(fd, value.data() + done, value.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail_io("cannot write the leader value of '" + name + "'");
    done += static_cast<std::size_t>(n);
  }
}

}  // namespace

ValueDraft::ValueDraft(const StateFile& file, const std::string& value) : file_(file) {
  Fd fd;
  for (int attempt = 0; !fd; ++attempt) {
    temp_ = file.base() + ".tmp." + std::to_string(getpid()) + ".v" + std::to_string(drafts.fetch_add(1));
    fd = Fd(openat(file.root_fd(), temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    // Taken: a leftover of a killed process that had our pid (gc removes it later).
    if (!fd && (errno != EEXIST || attempt == 100)) fail_io("cannot write the leader value of '" + file.name() + "'");
  }
  try {
    // Readable by the group where the group shares the directory (as the state files are).
    if (shared_by_group(file.root_fd()) && fchmod(fd.get(), 0660) != 0) {
      fail_io("cannot share the leader value of '" + file.name() + "'");
    }
    write_all(fd.get(), value, file.name());
  } catch (...) {
    unlinkat(file.root_fd(), temp_.c_str(), 0);
    throw;
  }
}

ValueDraft::~ValueDraft() {
  if (!placed_) unlinkat(file_.root_fd(), temp_.c_str(), 0);
}

void ValueDraft::place(std::uint64_t seq) {
  if (renameat(file_.root_fd(), temp_.c_str(), file_.root_fd(), file_.value_file(seq).c_str()) != 0) {
    fail_io("cannot place the leader value of '" + file_.name() + "'");
  }
  placed_ = true;
}

std::string read_value(const StateFile& file, std::uint64_t seq) {
  Fd fd(openat(file.root_fd(), file.value_file(seq).c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK));
  struct stat st {};
  if (!fd || fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return {};
  // At most the largest value (a longer file is not one turnstile wrote).
  std::string value(std::min<std::size_t>(static_cast<std::size_t>(st.st_size), max_election_value), '\0');
  std::size_t done = 0;
  while (done < value.size()) {
    const auto n = pread(fd.get(), value.data() + done, value.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<std::size_t>(n);
  }
  value.resize(done);
  return value;
}

bool parse_value_file(const std::string& file_name, std::string& state_file_name, std::uint64_t& seq) {
  const auto at = file_name.rfind(".v.");
  if (at == std::string::npos || at + 3 == file_name.size()) return false;
  const char* first = file_name.data() + at + 3;
  const char* last = file_name.data() + file_name.size();
  const auto [end, error] = std::from_chars(first, last, seq);
  if (error != std::errc() || end != last || seq == 0) return false;
  state_file_name = file_name.substr(0, at) + ".s";
  return true;
}

}  // namespace turnstile::detail::file_state
