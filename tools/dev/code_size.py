#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Prints the C++ files of src/ and tools/ over 600 lines and the functions over 60 lines.

The house rule (issue 23): no source file over 600 lines, no function over 60 lines, a function
counted from its signature's line to its closing brace. Exits 1 when anything exceeds, 0 when
nothing does; the totals are printed either way.

Functions are found with a brace matcher that skips comments, string and character literals
(raw strings included) and preprocessor lines: a '{' at namespace or class scope opens a
function body when what precedes it is a parameter list and its qualifiers (or a constructor's
member initializers). Lambdas and local classes count toward the function around them. Its
numbers agree with clang-tidy's readability-function-size (LineThreshold), which counts from
the opening brace's line: this script's count is clang-tidy's plus the lines from the
signature to the opening brace, plus one.

Usage: code_size.py [--root DIR] [--max-file-lines N] [--max-function-lines N] [PATH...]
(PATHs relative to the root; default src and tools).
"""

import argparse
import os
import re
import sys

SUFFIXES = (".cpp", ".hpp", ".cc", ".h", ".hh", ".cxx", ".hxx", ".ipp")
CHAR_PREFIXES = ("u8", "u", "U", "L")


def strip_code(text):
    """The text with comments, literals and preprocessor lines blanked (newlines kept), so
    that braces and parentheses left in it are the code's own."""
    out = []
    i, n = 0, len(text)
    at_line_start = True  # only blanks since the last newline
    while i < n:
        c = text[i]
        if c == "\n":
            out.append(c)
            at_line_start = True
            i += 1
            continue
        if at_line_start and c == "#":
            # A directive, with its backslash-continued lines.
            while i < n and text[i] != "\n":
                if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
                    out.append("\n")
                    i += 2
                    continue
                i += 1
            continue
        if not c.isspace():
            at_line_start = False
        if text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
            continue
        if text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:end]))
            i = end
            continue
        if c == '"':
            if re.search(r"(?:^|[^\w])(?:u8|u|U|L)?R$", text[max(0, i - 4) : i]):
                i = skip_raw_string(text, i, out)
            else:
                i = skip_quoted(text, i, '"', out)
            continue
        if c == "'":
            word = re.search(r"\w+$", text[max(0, i - 24) : i])
            if word and word.group(0) not in CHAR_PREFIXES:
                out.append(" ")  # a digit separator: 60'000
                i += 1
                continue
            i = skip_quoted(text, i, "'", out)
            continue
        out.append(c)
        i += 1
    return "".join(out)


def skip_quoted(text, i, quote, out):
    """Blanks the literal starting at text[i] (a quote); returns the index after it."""
    j = i + 1
    while j < len(text) and text[j] != quote and text[j] != "\n":
        j += 2 if text[j] == "\\" else 1
    if j >= len(text) or text[j] == "\n":  # unterminated: blank to the end of the line
        out.append(quote + " " * (j - i - 1))
        return j
    out.append(quote + " " * (j - i - 1) + quote)
    return j + 1


def skip_raw_string(text, i, out):
    """Blanks R"delim( ... )delim" starting at the quote text[i]; returns the index after it."""
    open_paren = text.find("(", i)
    delimiter = text[i + 1 : open_paren]
    end = text.find(")" + delimiter + '"', open_paren)
    end = len(text) if end < 0 else end + len(delimiter) + 2
    out.append("".join(ch if ch == "\n" else " " for ch in text[i:end]))
    return end


QUALIFIERS = re.compile(
    r"^(\s*(const|volatile|noexcept\s*(\([^)]*\))?|override|final|mutable|&&|&|try|"
    r"__attribute__\s*\(\(.*\)\)|->\s*[\w:<>,\s*&]+?|requires\b.*))*\s*$",
    re.S,
)
CLASS_HEAD = re.compile(r"^(template\s*<.*>\s*)?(class|struct|union)\b", re.S)
OTHER_HEAD = re.compile(r"^(template\s*<.*>\s*)?(enum|namespace|extern)\b", re.S)
LEADING_NOISE = re.compile(r"^(\s*(public|private|protected)\s*:|\s+)*")
TEMPLATE_HEAD = re.compile(r"^template\s*<")


def last_top_level_parens(header):
    """(open, close) of the last parenthesised group at depth 0 of `header`, or None."""
    depth, close = 0, None
    for k in range(len(header) - 1, -1, -1):
        ch = header[k]
        if ch == ")":
            if depth == 0:
                close = k
            depth += 1
        elif ch == "(":
            depth -= 1
            if depth == 0 and close is not None:
                return k, close
    return None


def top_level(header):
    """(index, character) of `header` outside parentheses and brackets."""
    depth = 0
    for k, ch in enumerate(header):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif depth == 0:
            yield k, ch


def initializer_list_start(header):
    """Index of a constructor's ':' that starts member initializers after its parameter list,
    or None."""
    for k, ch in top_level(header):
        if ch == ":" and header[k + 1 : k + 2] != ":" and header[k - 1 : k] != ":":
            before = re.sub(r"\s*(noexcept\s*(\([^)]*\))?)?\s*$", "", header[:k])
            return k if before.endswith(")") else None
    return None


def parameter_list(header):
    """(open, close) of the parameter list: the last top-level parentheses before member
    initializers, if any."""
    init = initializer_list_start(header)
    head = header if init is None else header[:init]
    parens = last_top_level_parens(head)
    while parens and head[: parens[0]].rstrip().endswith("__attribute__"):  # after the parameters
        head = head[: parens[0]].rstrip()[: -len("__attribute__")]
        parens = last_top_level_parens(head)
    return parens


def top_level_assignment(header):
    """Whether `header` has an '=' outside parentheses and brackets: an initializer, not a
    function (operator= and friends aside)."""
    for k, ch in top_level(header):
        if ch != "=" or header[k + 1 : k + 2] == "=" or re.search(r"operator\s*[=!<>+\-*/%^&|]*$", header[:k].rstrip()):
            continue
        return True
    return False


def function_name(header, parens):
    open_paren, close = parens
    match = re.search(r"((?:[A-Za-z_~][\w]*\s*(?:<[^()]*>)?\s*::\s*)*~?(?:operator\s*(?:\(\s*\)|[^\s(]+)|[A-Za-z_]\w*))\s*$",
                      header[:open_paren])
    name = re.sub(r"\s*::\s*", "::", re.sub(r"\s+", " ", match.group(1))) if match else "?"
    if re.fullmatch(r"[A-Z][A-Z0-9_]*", name):  # a macro such as TEST(Suite, Case)
        name += re.sub(r"\s+", " ", header[open_paren : close + 1])
    return name


def classify(header, prev_char):
    """What a '{' at namespace or class scope opens: 'function', 'class', 'other' (namespace,
    enum, extern "C": scanned on) or 'expression' (an initializer: not a function)."""
    head = LEADING_NOISE.sub("", header)
    if CLASS_HEAD.match(head) and "(" not in head.split("{")[0].split(":")[0]:
        return "class"
    if OTHER_HEAD.match(head):
        return "namespace" if not head.startswith("enum") else "expression"
    parens = parameter_list(head)
    if parens is None or top_level_assignment(head[: parens[0]]):
        return "expression"
    if initializer_list_start(head) is not None:
        # In member initializers, `name{...}` is an initializer; the body follows ')' or '}'.
        return "function" if prev_char in ")}" else "expression"
    if QUALIFIERS.match(head[parens[1] + 1 :]):
        return "function"
    return "expression"


def scan(text):
    """Yields (name, signature line, closing brace's line, opening brace's line) for every
    function defined in `text`."""
    code = strip_code(text)
    line_of = []
    line = 1
    for ch in code:
        line_of.append(line)
        line += ch == "\n"
    stack = []  # the open blocks: (kind, signature line, name)
    function_depth = 0  # blocks open inside the innermost function, itself included
    header_start = 0  # where the declaration before the next '{' starts
    paren_depth = 0
    expression_braces = 0  # braces of an initializer (or a lambda in one) at scope level
    prev = ""
    for k, ch in enumerate(code):
        if function_depth > 0:
            if ch == "{":
                function_depth += 1
            elif ch == "}":
                function_depth -= 1
                if function_depth == 0:
                    _, first, name, brace = stack.pop()
                    yield name, first, line_of[k], brace
                    header_start = k + 1
        elif ch == "(":
            paren_depth += 1
        elif ch == ")":
            paren_depth -= 1
        elif ch == "{" and (paren_depth > 0 or expression_braces > 0):
            expression_braces += 1
        elif ch == "{":
            header = code[header_start:k]
            kind = classify(header, prev)
            if kind == "expression":
                expression_braces += 1
            else:
                stack.append((kind,) + signature(code, header_start, k, line_of, kind) + (line_of[k],))
                function_depth = 1 if kind == "function" else 0
                header_start = k + 1
        elif ch == "}":
            if expression_braces > 0:
                expression_braces -= 1
            elif stack:
                stack.pop()
                header_start = k + 1
        elif ch == ";" and paren_depth == 0 and expression_braces == 0:
            header_start = k + 1
        elif ch == ":" and paren_depth == 0 and expression_braces == 0:
            if re.search(r"\b(public|private|protected)\s*$", code[header_start:k]):
                header_start = k + 1
        if not ch.isspace():
            prev = ch


def signature(code, header_start, brace, line_of, kind):
    """(line, name) of the declaration code[header_start:brace]: the line of its first token
    after access specifiers and a template head."""
    header = code[header_start:brace]
    start = header_start + len(header) - len(LEADING_NOISE.sub("", header))
    if kind != "function":
        return line_of[start] if start < brace else line_of[brace], None
    if TEMPLATE_HEAD.match(code, start):
        start += template_end(code[start:brace])
        start += len(code[start:brace]) - len(code[start:brace].lstrip())
    head = code[start:brace]
    return line_of[start], function_name(head, parameter_list(head))


def source_files(root, paths):
    for path in paths:
        full = os.path.join(root, path)
        if os.path.isfile(full):
            yield path
            continue
        for directory, subdirectories, files in os.walk(full):
            subdirectories.sort()
            for file in sorted(files):
                if file.endswith(SUFFIXES):
                    yield os.path.relpath(os.path.join(directory, file), root)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    parser.add_argument("--max-file-lines", type=int, default=600)
    parser.add_argument("--max-function-lines", type=int, default=60)
    parser.add_argument("paths", nargs="*", default=["src", "tools"])
    args = parser.parse_args()
    root = os.path.normpath(args.root)

    long_files, long_functions = [], []
    files = lines = functions = 0
    for path in source_files(root, args.paths):
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as source:
            text = source.read()
        count = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
        files += 1
        lines += count
        if count > args.max_file_lines:
            long_files.append((count, path))
        for name, first, last, _ in scan(text):
            functions += 1
            length = last - first + 1
            if length > args.max_function_lines:
                long_functions.append((length, path, first, name))

    for count, path in sorted(long_files, key=lambda item: (-item[0], item[1])):
        print(f"file     {count:5d} lines  {path}")
    for length, path, first, name in sorted(long_functions, key=lambda item: (-item[0], item[1], item[2])):
        print(f"function {length:5d} lines  {path}:{first}  {name}")
    print(f"{files} files, {lines} lines, {functions} functions; "
          f"{len(long_files)} files over {args.max_file_lines} lines, "
          f"{len(long_functions)} functions over {args.max_function_lines} lines")
    return 1 if long_files or long_functions else 0


if __name__ == "__main__":
    sys.exit(main())
