#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plants the safety mutants of tests/mutants/mutants.ini one at a time and runs the tests that
should catch each (make mutants). A mutant is caught when at least one of its tests fails.

Each mutant replaces one exact piece of text (it must occur exactly once in its file) in the
source tree, is built incrementally in a build directory of its own (build-mutants by
default, configured here on first use), and its tests run through CTest there (the server
fixtures start as in make test). The file is restored right after, and also when the run is
interrupted (SIGINT, SIGTERM, SIGHUP): the original is kept in BUILD/planted/ until restored,
and a run killed outright (SIGKILL) restores it at its next start. Do not edit the planted
file while a run is going on.

Results: caught, MISSED, stale (the original text is no longer in the file: update the list),
invalid (the mutant does not build), skipped (its backend or its tests are not built here).
The score is caught / (caught + missed)."""
import argparse
import configparser
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SAFETY_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(Exception):
    pass


def on_signal(signum, _frame):
    raise Interrupted(signal.Signals(signum).name)


def unescape(text):
    """The list's values: \\n is a newline, \\t a tab, \\\\ a backslash."""
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}.get(m.group(1), m.group(0)), text)


def load_mutants(path):
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str
    with open(path, encoding="utf-8") as f:
        parser.read_file(f)
    mutants = []
    for name in parser.sections():
        section = parser[name]
        missing = [k for k in ("backend", "rule", "file", "original", "replacement", "tests") if k not in section]
        if missing:
            sys.exit(f"{path}: [{name}] lacks {', '.join(missing)}")
        mutants.append({
            "id": name,
            "backend": section["backend"],
            "rule": section["rule"],
            "file": section["file"],
            "original": unescape(section["original"]),
            "replacement": unescape(section["replacement"]),
            "tests": section["tests"],
            "timeout": section.get("timeout", ""),
        })
    return mutants


class Planter:
    """Plants one mutant at a time; the original stays in BUILD/planted/ until restored."""

    def __init__(self, build):
        self.journal = build / "planted" / "journal.json"
        self.journal.parent.mkdir(parents=True, exist_ok=True)

    def restore_leftover(self, quiet=False):
        # No signal may cut a restore short: they wait until it is done.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SAFETY_SIGNALS)
        try:
            if not self.journal.exists():
                return
            entry = json.loads(self.journal.read_text())
            original = Path(entry["backup"]).read_bytes()
            (ROOT / entry["file"]).write_bytes(original)
            if not quiet:
                print(f"restored {entry['file']} from an interrupted run", flush=True)
            self.journal.unlink()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def plant(self, mutant):
        """True when planted; False when the original text is not exactly once in the file."""
        path = ROOT / mutant["file"]
        if not path.exists():
            return False
        text = path.read_bytes()
        original = mutant["original"].encode()
        if text.count(original) != 1:
            return False
        backup = self.journal.parent / "original"
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SAFETY_SIGNALS)
        try:
            backup.write_bytes(text)
            self.journal.write_text(json.dumps({"file": mutant["file"], "backup": str(backup)}))
            path.write_bytes(text.replace(original, mutant["replacement"].encode()))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return True

    def restore(self):
        self.restore_leftover(quiet=True)


def run(command, log, cwd=ROOT, timeout=None):
    """Runs `command` in a process group of its own (ended as a whole when we are interrupted),
    its output appended to `log`. Returns its exit status."""
    with open(log, "a", encoding="utf-8") as out:
        out.write(f"\n$ {' '.join(command)}\n")
        out.flush()
        process = subprocess.Popen(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return process.wait(timeout=timeout)
        except BaseException:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()
            raise


def configure(build, jobs, log):
    if (build / "CMakeCache.txt").exists():
        return
    options = ["-DCMAKE_BUILD_TYPE=RelWithDebInfo", "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG",
               "-DTURNSTILE_BUILD_BENCH=OFF", "-DTURNSTILE_BUILD_EXAMPLES=OFF"]
    if subprocess.run(["sh", "-c", "command -v ccache"], capture_output=True).returncode == 0:
        options.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
    # Backends left out with MUTANTS_CMAKE_ARGS, e.g. "-DTURNSTILE_BACKEND_ETCD=OFF".
    options += os.environ.get("MUTANTS_CMAKE_ARGS", "").split()
    if run(["cmake", "-S", str(ROOT), "-B", str(build)] + options, log) != 0:
        sys.exit(f"configuring {build} failed: see {log}")


def build_all(build, jobs, log):
    return run(["nice", "cmake", "--build", str(build), "-j", str(jobs)], log)


def backend_built(build, backend):
    if backend in ("core", "file", "cli"):
        return True
    cache = (build / "CMakeCache.txt").read_text()
    flag = re.search(rf"^TURNSTILE_BACKEND_{backend.upper()}:BOOL=(\w+)", cache, re.M)
    return flag is None or flag.group(1).upper() in ("ON", "TRUE", "1")


def tests_matching(build, regex):
    listing = subprocess.run(["ctest", "--test-dir", str(build), "-N", "-R", regex], capture_output=True, text=True)
    return [line.split(":", 1)[1].strip() for line in listing.stdout.splitlines() if re.match(r"\s*Test\s+#\d+:", line)]


def failed_tests(log_text):
    after = log_text.rsplit("The following tests FAILED:", 1)
    if len(after) < 2:
        return []
    return [m.group(1) for m in re.finditer(r"^\s*\d+ - (\S+)", after[1], re.M)]


def try_mutant(mutant, build, planter, jobs, log_dir):
    log = log_dir / f"{mutant['id']}.log"
    log.write_text("")
    if not backend_built(build, mutant["backend"]):
        return "skipped", f"the {mutant['backend']} backend is not built in {build}"
    tests = tests_matching(build, mutant["tests"])
    if not tests:
        return "skipped", f"no test matches {mutant['tests']}"
    if not planter.plant(mutant):
        return "stale", f"the original text is not exactly once in {mutant['file']}"
    try:
        if build_all(build, jobs, log) != 0:
            return "invalid", f"does not build (see {log})"
        timeout = ["--timeout", mutant["timeout"]] if mutant["timeout"] else []
        status = run(["ctest", "--test-dir", str(build), "-R", mutant["tests"], "-j", str(jobs)] + timeout, log)
    finally:
        planter.restore()
    failed = failed_tests(log.read_text(errors="replace"))
    if status != 0 and failed:
        return "caught", "by " + ", ".join(failed[:4]) + (f" and {len(failed) - 4} more" if len(failed) > 4 else "")
    if status != 0:
        return "caught", f"ctest failed (status {status}; see {log})"
    return "MISSED", f"{len(tests)} tests passed"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=str(ROOT / "build-mutants"), help="the build directory (default build-mutants)")
    parser.add_argument("--list", default=str(ROOT / "tests/mutants/mutants.ini"), help="the mutants")
    parser.add_argument("--only", default=os.environ.get("MUTANTS_ONLY", ""), help="ids or backends matching this regex")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()

    for signum in SAFETY_SIGNALS:
        signal.signal(signum, on_signal)
    build = Path(args.build).resolve()
    build.mkdir(parents=True, exist_ok=True)
    planter = Planter(build)
    planter.restore_leftover()
    log_dir = build / "mutant-logs"
    log_dir.mkdir(exist_ok=True)
    mutants = load_mutants(args.list)
    if args.only:
        mutants = [m for m in mutants if re.search(args.only, m["id"]) or re.search(args.only, m["backend"])]

    results = []
    try:
        configure(build, args.jobs, log_dir / "configure.log")
        if build_all(build, args.jobs, log_dir / "build.log") != 0:
            sys.exit(f"the unmutated tree does not build in {build}: see {log_dir / 'build.log'}")
        for mutant in mutants:
            started = time.monotonic()
            outcome, detail = try_mutant(mutant, build, planter, args.jobs, log_dir)
            took = time.monotonic() - started
            results.append((mutant, outcome, detail))
            print(f"{outcome:8} {mutant['id']} [{mutant['backend']}: {mutant['rule']}] {detail} ({took:.0f} s)", flush=True)
    except Interrupted as why:
        print(f"interrupted ({why}); the tree is restored", flush=True)
    finally:
        planter.restore()

    caught = sum(1 for _, outcome, _ in results if outcome == "caught")
    missed = [m["id"] for m, outcome, _ in results if outcome == "MISSED"]
    other = {}
    for m, outcome, _ in results:
        if outcome not in ("caught", "MISSED"):
            other.setdefault(outcome, []).append(m["id"])
    judged = caught + len(missed)
    print(f"\nscore: {caught} of {judged} caught" + (f" ({100 * caught / judged:.0f} %)" if judged else ""))
    if missed:
        print("missed: " + ", ".join(missed))
    for outcome, ids in sorted(other.items()):
        print(f"{outcome}: " + ", ".join(ids))
    return 1 if missed or "stale" in other or "invalid" in other else 0


if __name__ == "__main__":
    sys.exit(main())
