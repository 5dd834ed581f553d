#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Checks that C++ sources follow .clang-format (Google based, 120 columns), changing nothing.
#   tests/check_format.sh              every C++ file of the tree (generated and build trees excepted)
#   tests/check_format.sh FILE...      only these files
# Prints each file that clang-format would change, with the first lines of its diff, and exits 1;
# `clang-format -i FILE...` applies the format. make test runs this first: it fails in seconds.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
command -v clang-format >/dev/null || { echo "check_format: clang-format is missing (Debian: clang-format)" >&2; exit 2; }
if [ $# -eq 0 ]; then
  # Tracked files when this is a git checkout (no build trees, nothing generated); otherwise the
  # source folders, which hold no generated code either (protobuf's goes to the build tree).
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    set -- $(git ls-files '*.cpp' '*.hpp' '*.h' '*.cc')
  else
    set -- $(find include src tools tests examples bench -name '*.cpp' -o -name '*.hpp' -o -name '*.h' -o -name '*.cc')
  fi
fi
bad=0
diff_file=$(mktemp)
trap 'rm -f "$diff_file"' EXIT
for file in "$@"; do
  if ! clang-format --style="file:$root/.clang-format" "$file" | diff -u "$file" - >"$diff_file" 2>&1; then
    echo "not formatted: $file" >&2
    sed -n '3,12p' "$diff_file" >&2
    bad=$((bad + 1))
  fi
done
if [ "$bad" -gt 0 ]; then
  echo "check_format: $bad of $# files differ from .clang-format (clang-format -i FILE... formats them)" >&2
  exit 1
fi
echo "check_format: $# files follow .clang-format"
