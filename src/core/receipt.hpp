// SPDX-License-Identifier: Apache-2.0
// The text of a release receipt (BackendHold::receipt, Backend::release_receipt): a backend's
// tag and its fields, separated by spaces, each escaped so that names and keys (which may hold
// spaces) come back whole. Control characters never occur in names; '%' and ' ' are escaped.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace turnstile::detail {

inline std::string receipt_text(const std::vector<std::string>& fields) {
  std::string text;
  for (const auto& field : fields) {
    if (!text.empty()) text += ' ';
    for (const char c : field) {
      if (c == '%') {
        text += "%25";
      } else if (c == ' ') {
        text += "%20";
      } else {
        text += c;
      }
    }
  }
  return text;
}

// The fields of `text` when it is a receipt tagged `tag` with `count` fields (the tag one of
// them; 0: any number); nullopt otherwise.
inline std::optional<std::vector<std::string>> receipt_fields(const std::string& text, const std::string& tag,
                                                              std::size_t count) {
  std::vector<std::string> fields(1);
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] == ' ') {
      fields.emplace_back();
    } else if (text.compare(i, 3, "%25") == 0 || text.compare(i, 3, "%20") == 0) {
      fields.back() += text[i + 2] == '5' ? '%' : ' ';
      i += 2;
    } else if (static_cast<unsigned char>(text[i]) < 0x20 || text[i] == '%') {
      return std::nullopt;
    } else {
      fields.back() += text[i];
    }
  }
  if ((count != 0 && fields.size() != count) || fields.front() != tag) return std::nullopt;
  return fields;
}

}  // namespace turnstile::detail
