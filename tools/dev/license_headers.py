#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Checks (or adds) the SPDX license line of every source file the project owns.

turnstile is under the Apache License 2.0 (LICENSE). Each C++, CMake, shell, Python, Lua, Java
and protobuf file the repository tracks says so in its first lines, in the SPDX form tools such
as `reuse` and Debian's licensecheck read:

    // SPDX-License-Identifier: Apache-2.0        (C++, Java, protobuf)
    -- SPDX-License-Identifier: Apache-2.0        (Lua)
    # SPDX-License-Identifier: Apache-2.0         (CMake, shell, Python, Makefile)

A script's `#!` line stays first. Documentation, data and generated files carry none: the
copyright file of the Debian packages and LICENSE cover them.

Usage: license_headers.py [--root DIR] [--add]   (exit 1 when a file lacks the line)
"""

import argparse
import os
import subprocess
import sys

TAG = "SPDX-License-Identifier: Apache-2.0"
COMMENT_BY_SUFFIX = {
    ".cpp": "//", ".hpp": "//", ".h": "//", ".java": "//", ".proto": "//",
    ".lua": "--",
    ".cmake": "#", ".sh": "#", ".py": "#",
}
COMMENT_BY_NAME = {"CMakeLists.txt": "#", "Makefile": "#", "run": "#"}
# Templates CMake fills in: only those whose output is CMake itself take the line (a Debian
# changelog or a pkg-config file has its own format, read byte for byte).
COMMENT_BY_TEMPLATE = {".cmake.in": "#"}


def comment_for(path):
    name = os.path.basename(path)
    if name in COMMENT_BY_NAME:
        return COMMENT_BY_NAME[name]
    for suffix, comment in COMMENT_BY_TEMPLATE.items():
        if path.endswith(suffix):
            return comment
    return COMMENT_BY_SUFFIX.get(os.path.splitext(name)[1])


def tracked_files(root):
    listing = subprocess.run(["git", "-C", root, "ls-files", "-z"], check=True, capture_output=True).stdout
    return [p for p in listing.decode().split("\0") if p]


def has_tag(text):
    return TAG in "\n".join(text.splitlines()[:5])


def with_tag(text, comment):
    line = f"{comment} {TAG}\n"
    if text.startswith("#!"):
        first, _, rest = text.partition("\n")
        return f"{first}\n{line}{rest}"
    return line + text


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    parser.add_argument("--add", action="store_true", help="add the line where it is missing")
    args = parser.parse_args()
    missing = []
    for path in tracked_files(args.root):
        comment = comment_for(path)
        full = os.path.join(args.root, path)
        if comment is None or not os.path.isfile(full):
            continue
        with open(full, encoding="utf-8") as handle:
            text = handle.read()
        if has_tag(text):
            continue
        if args.add:
            with open(full, "w", encoding="utf-8") as handle:
                handle.write(with_tag(text, comment))
        else:
            missing.append(path)
    for path in missing:
        print(f"{path}: no '{TAG}' line in its first lines")
    print(f"license headers: {len(missing)} file(s) without the SPDX line")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
