// SPDX-License-Identifier: Apache-2.0
#include "text_table.hpp"

#include <locale.h>
#include <wchar.h>

#include <algorithm>

#include "common.hpp"

namespace turnstile::cli {
namespace {

// C.UTF-8's character classes for wcwidth(), made once; nullptr without that locale.
locale_t utf8_locale() {
  static const locale_t made = newlocale(LC_CTYPE_MASK, "C.UTF-8", static_cast<locale_t>(nullptr));
  return made;
}

}  // namespace

std::size_t display_width(std::string_view text) {
  const locale_t utf8 = utf8_locale();
  // wcwidth() reads the calling thread's locale: C.UTF-8 for this call only.
  const locale_t previous = utf8 ? uselocale(utf8) : static_cast<locale_t>(nullptr);
  std::size_t width = 0;
  for (std::size_t i = 0; i < text.size();) {
    char32_t code_point = static_cast<unsigned char>(text[i]);
    const std::size_t length = code_point < 0x80 ? 1 : utf8_length(text, i, code_point);
    i += length == 0 ? 1 : length;  // a byte that is not UTF-8 (printable() leaves none): as one
    const int columns = utf8 && length != 0 ? wcwidth(static_cast<wchar_t>(code_point)) : 1;
    width += columns < 0 ? 1 : static_cast<std::size_t>(columns);  // unassigned: as one
  }
  if (utf8) uselocale(previous);
  return width;
}

std::string aligned_rows(const std::vector<std::vector<std::string>>& rows, const std::vector<TableColumn>& columns,
                         std::size_t gap) {
  std::vector<std::size_t> widths;
  for (const auto& column : columns) widths.push_back(column.min_width);
  for (const auto& row : rows) {
    for (std::size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], display_width(row[i]));
  }
  std::string out;
  for (const auto& row : rows) {
    for (std::size_t i = 0; i < row.size(); ++i) {
      const std::size_t padding = widths[i] - display_width(row[i]);
      const bool last = i + 1 == row.size();
      if (columns[i].right_aligned) out.append(padding, ' ');
      out += row[i];
      if (!last) out.append((columns[i].right_aligned ? 0 : padding) + gap, ' ');
    }
    out += '\n';
  }
  return out;
}

}  // namespace turnstile::cli
