#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The docs stay true to the tree.

  docs_test.py SOURCE_DIR [CLI]

Fails (exit 1, one line per problem) when, in README.md, CHANGELOG.md or docs/**/*.md:
  * a relative link names a file or directory that does not exist, or an anchor (#...) that no
    heading of the linked Markdown file makes (GitHub's heading ids);
  * README.md is longer than its front-page budget (250 lines);
  * a code block the README says is quoted from a file (a line `<!-- quoted from PATH -->` just
    before it) differs from that file, so the README's example is one that CI builds;
  * a path relative to the document (../x) names nothing in the repository, or a document names
    a path in the developers' machine (/work/...): the docs refer only to the repository;
  * README.md's and docs/cli.md's exit-status tables, or the man page's EXIT STATUS, lack a status
    the CLI defines (tools/turnstile/common.hpp, kExit...);
  * the man page's OPTIONS lack an entry for --backend or a hold option (--lock, --read, --write,
    --semaphore, --limit), or its backend list lacks a scheme the library knows
    (src/core/backend_loader.cpp);
and, given the built CLI, when the man page (docs/turnstile.1) has no entry (a .TP paragraph)
for an option that `turnstile --help` or a subcommand's --help lists: the man page is the
complete CLI reference.
"""
import pathlib
import re
import subprocess
import sys

README_BUDGET = 250
LINK = re.compile(r"(?<!\!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*([^)\s]+)\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
QUOTED = re.compile(r"^<!--\s*quoted from\s+(\S+)\s*-->\s*$")


def prose_lines(text):
    """(line number, line) outside fenced code blocks, inline code spans blanked."""
    in_fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            yield number, re.sub(r"`+[^`]*`+", "``", line)


def slug(heading):
    """GitHub's id for a heading: lower case, punctuation dropped, spaces become hyphens."""
    text = re.sub(r"`", "", heading.strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        ids, seen = set(), {}
        in_fence = False
        for line in path.read_text(encoding="utf-8").splitlines():
            if FENCE.match(line):
                in_fence = not in_fence
                continue
            match = None if in_fence else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if match:
                base = slug(match.group(1))
                count = seen.get(base, 0)
                seen[base] = count + 1
                ids.add(base if count == 0 else f"{base}-{count}")
        cache[path] = ids
    return cache[path]


def check_links(root, doc, problems):
    text = doc.read_text(encoding="utf-8")
    for number, line in prose_lines(text):
        for match in list(LINK.finditer(line)) + list(IMAGE.finditer(line)):
            target = match.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
                continue
            where = f"{doc.relative_to(root)}:{number}"
            path_part, _, anchor = target.partition("#")
            linked = (doc.parent / path_part).resolve() if path_part else doc
            if path_part and not linked.exists():
                problems.append(f"{where}: broken link {target!r} (no {path_part})")
                continue
            if anchor and linked.suffix == ".md" and linked.is_file():
                if anchor not in anchors(linked):
                    problems.append(f"{where}: broken anchor {target!r} (no such heading)")


def check_readme(root, problems):
    readme = root / "README.md"
    lines = readme.read_text(encoding="utf-8").splitlines()
    if len(lines) > README_BUDGET:
        problems.append(f"README.md: {len(lines)} lines, over the front page's {README_BUDGET}: move detail to docs/")
    for index, line in enumerate(lines):
        match = QUOTED.match(line)
        if not match:
            continue
        quoted = root / match.group(1)
        if index + 1 >= len(lines) or not FENCE.match(lines[index + 1]):
            problems.append(f"README.md:{index + 1}: 'quoted from' is not followed by a code block")
            continue
        end = next((i for i in range(index + 2, len(lines)) if FENCE.match(lines[i])), None)
        block = "\n".join(lines[index + 2:end]).strip("\n") if end else ""
        if not quoted.is_file():
            problems.append(f"README.md:{index + 1}: quotes {match.group(1)}, which does not exist")
        elif block != without_license_line(quoted.read_text(encoding="utf-8")).strip("\n"):
            problems.append(f"README.md:{index + 1}: the code block differs from {match.group(1)}")


def without_license_line(text):
    """A source file as the README quotes it: without its SPDX line (tools/dev/license_headers.py)."""
    return "".join(line for line in text.splitlines(keepends=True) if "SPDX-License-Identifier:" not in line)


def check_paths(root, doc, problems):
    """A relative path mentioned anywhere (link or not) exists in the repository; no /work/ path."""
    for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        where = f"{doc.relative_to(root)}:{number}"
        for match in re.finditer(r"(?<![\w.])((?:\.\./)+[\w.+/-]*)", line):
            target = (doc.parent / match.group(1).split("#")[0]).resolve()
            if not target.is_relative_to(root) or not target.exists():
                problems.append(f"{where}: {match.group(1)} is not a path in the repository")
        if re.search(r"(?<![\w.])/work/", line):
            problems.append(f"{where}: names a path outside the repository (/work/...)")


def exit_statuses(root):
    header = (root / "tools" / "turnstile" / "common.hpp").read_text(encoding="utf-8")
    return sorted(set(re.findall(r"kExit\w+\s*=\s*(\d+)", header)), key=int)


def table_statuses(text):
    """The statuses a Markdown exit-status table lists: numbers in the rows' first cells."""
    found = set()
    for line in text.splitlines():
        cell = re.match(r"^\|\s*([^|]*)\|", line)
        if cell:
            found.update(re.findall(r"\b(\d+)\b", cell.group(1)))
    return found


def check_exit_statuses(root, problems):
    statuses = exit_statuses(root)
    if not statuses:
        problems.append("tools/turnstile/common.hpp: no kExit... statuses found")
    for doc in ["README.md", "docs/cli.md"]:
        listed = table_statuses((root / doc).read_text(encoding="utf-8"))
        for status in statuses:
            if status not in listed:
                problems.append(f"{doc}: the exit-status table lacks {status}")
    man = (root / "docs" / "turnstile.1").read_text(encoding="utf-8")
    section = man.split(".SH EXIT STATUS", 1)[-1].split("\n.SH ", 1)[0]
    tagged = set(re.findall(r"\b(\d+)\b", "\n".join(l for l in section.splitlines() if l.startswith(".B "))))
    for status in statuses:
        if status not in tagged:
            problems.append(f"docs/turnstile.1: EXIT STATUS lacks {status}")


def check_man_page_lists(root, problems):
    man = (root / "docs" / "turnstile.1").read_text(encoding="utf-8")
    options = man.split(".SH OPTIONS", 1)[-1].split("\n.SH ", 1)[0]
    documented = documented_options(options)
    for option in ["--backend", "--lock", "--read", "--write", "--semaphore", "--limit"]:
        if option not in documented:
            problems.append(f"docs/turnstile.1: OPTIONS has no .TP entry for {option}")
    loader = (root / "src" / "core" / "backend_loader.cpp").read_text(encoding="utf-8")
    plain = man.replace("\\-", "-").replace("\\fB", "").replace("\\fR", "")
    for scheme in re.findall(r'^\s*\{"([a-z+]+)", "[a-z]+",', loader, re.M):
        if f"{scheme}://" not in plain:
            problems.append(f"docs/turnstile.1: the backend list lacks {scheme}://")


def long_options(help_text):
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", help_text))


def documented_options(man_text):
    """The long options the man page defines: those in the tag line of a .TP paragraph."""
    lines = man_text.replace("\\-", "-").splitlines()
    tags = [lines[i + 1] for i, line in enumerate(lines[:-1]) if line.strip() == ".TP"]
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", "\n".join(tags)))


def check_man_page(root, cli, problems):
    documented = documented_options((root / "docs" / "turnstile.1").read_text(encoding="utf-8"))
    for command in [[], ["run"], ["hold"], ["inspect"], ["gc"], ["demo"], ["demo", "parking"]]:
        args = [cli] + command + ["--help"]
        out = subprocess.run(args, capture_output=True, text=True, check=False)
        text = out.stdout + out.stderr
        if out.returncode != 0 or "Usage:" not in text:
            problems.append(f"turnstile {' '.join(command + ['--help'])}: exit {out.returncode}, no usage")
            continue
        for option in sorted(long_options(text) - documented):
            problems.append(f"docs/turnstile.1: no .TP entry for {option}, which "
                            f"turnstile {' '.join(command + ['--help'])} lists")


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    root = pathlib.Path(sys.argv[1]).resolve()
    problems = []
    docs = [root / "README.md", root / "CHANGELOG.md"] + sorted((root / "docs").rglob("*.md"))
    for doc in docs:
        if not doc.is_file():
            problems.append(f"{doc.relative_to(root)}: missing")
            continue
        check_links(root, doc, problems)
        check_paths(root, doc, problems)
    check_readme(root, problems)
    check_exit_statuses(root, problems)
    check_man_page_lists(root, problems)
    if len(sys.argv) == 3:
        check_man_page(root, sys.argv[2], problems)
    for problem in problems:
        print(f"FAIL: {problem}")
    if problems:
        sys.exit(1)
    print(f"docs: {len(docs)} Markdown files, links and anchors resolve; README quotes match")


if __name__ == "__main__":
    main()
