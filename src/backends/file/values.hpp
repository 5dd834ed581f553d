// SPDX-License-Identifier: Apache-2.0
// Election candidates' values on file://: one small file per candidate beside the state file,
// <base>.v.<seq> (state.hpp: kHasValue). Every rename into that name happens under the state
// file's guard, after the slot it belongs to was checked (proclaim) or before the slot is
// appended (join), so that whoever holds the guard sees a value file for every slot marked
// kHasValue. A file is written in full aside first and renamed over: a reader sees a whole old
// value or a whole new one, never a part.
#pragma once

#include <cstdint>
#include <string>

#include "backends/file/state_file.hpp"

namespace turnstile::detail::file_state {

// A value written aside (<base>.tmp.<pid>.<n>, the name `turnstile gc` removes when a process
// was killed before placing it), then placed under the guard; removed if never placed.
class ValueDraft {
 public:
  // Writes `value` (outside the guard: the guard is held only for the rename). Throws
  // BackendUnavailable when the directory refuses it.
  ValueDraft(const StateFile& file, const std::string& value);
  ~ValueDraft();
  ValueDraft(const ValueDraft&) = delete;
  ValueDraft& operator=(const ValueDraft&) = delete;
  // Under the guard: the value becomes entry `seq`'s, replacing the one it had (one rename).
  void place(std::uint64_t seq);

 private:
  const StateFile& file_;
  std::string temp_;
  bool placed_ = false;
};

// Under the guard: the value of entry `seq` ("" when its file cannot be read).
std::string read_value(const StateFile& file, std::uint64_t seq);

// The seq a directory entry is the value file of, and its state file's name (<base>.s); false
// when it is not a value file.
bool parse_value_file(const std::string& file_name, std::string& state_file_name, std::uint64_t& seq);

}  // namespace turnstile::detail::file_state
