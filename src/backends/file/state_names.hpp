// SPDX-License-Identifier: Apache-2.0
// Reading a backend directory back into names (state_names.cpp), for the listing of names in use
// (FileBackend::queue_names) and for `turnstile gc` (collect.cpp): one reader, so both agree on
// which files are state files and whose.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace turnstile::detail::file_state {

// The entries of the directory open on `root_fd` that may be state files or their temporaries
// (n.* and h.*), in directory order.
std::vector<std::string> state_directory_entries(int root_fd);

enum class Versions { current, any };

// The name a directory entry is the state of: n.<percent-encoded name>.s by its file name,
// h.<hash>.<…>.s by the name the file stores (long names). `current`: only a state file of this
// version whose stored name agrees (what a listing can inspect); `any`: an n.* file of any version
// too (what gc may open, to replace one from an earlier boot or to keep one in use).
std::optional<std::string> name_of_state_file(int root_fd, std::string_view file_name, Versions versions);

}  // namespace turnstile::detail::file_state
