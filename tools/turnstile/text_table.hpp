// SPDX-License-Identifier: Apache-2.0
// The CLI's tables (inspect NAME, inspect with no name): columns that line up on a terminal
// whatever their cells hold.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace turnstile::cli {

// How many terminal columns `text` takes (text from printable(): well-formed UTF-8, no control
// characters): wcwidth() of each character in the C.UTF-8 locale, so an East Asian wide
// character takes two and a combining mark none; one per character should that locale be
// missing.
std::size_t display_width(std::string_view text);

// One column of a table: at least `min_width` wide (a table keeps its shape from look to look),
// its cells padded on the right (or, `right_aligned`, on the left, for numbers).
struct TableColumn {
  std::size_t min_width = 0;
  bool right_aligned = false;
};

// `rows` (the header first) as lines: each column as wide as its widest cell, by
// display_width(), and `gap` spaces after it; the last column is not padded. A row may have
// fewer cells than `columns`, never more.
std::string aligned_rows(const std::vector<std::vector<std::string>>& rows, const std::vector<TableColumn>& columns,
                         std::size_t gap);

}  // namespace turnstile::cli
