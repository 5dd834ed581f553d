#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Reads metrics_text's output (stdin) with Prometheus' own parser and checks what it found:
the families and their types, the escaped name label read back as written, and the counts of
the holds metrics_text took (3 Mutex holds, 1 admitted and 1 timed-out Semaphore acquire)."""
import sys

from prometheus_client.parser import text_string_to_metric_families


def main():
    families = {family.name: family for family in text_string_to_metric_families(sys.stdin.read())}
    expected_types = {
        "turnstile_acquire_wait_seconds": "histogram",
        "turnstile_hold_seconds": "histogram",
        "turnstile_holds": "gauge",
        "turnstile_holds_suspended": "counter",
        "turnstile_holds_lost": "counter",
        "turnstile_renewal_seconds": "histogram",
        "turnstile_renewal_failures": "counter",
        "turnstile_connections": "counter",
        "turnstile_reconnects": "counter",
        "turnstile_background_removals_pending": "gauge",
        "turnstile_background_removal_retries": "counter",
    }
    problems = []
    for name, kind in expected_types.items():
        if name not in families:
            problems.append(f"missing family {name} (found {sorted(families)})")
        elif families[name].type != kind:
            problems.append(f"{name} is a {families[name].type}, not a {kind}")

    def sample(family, suffix, **labels):
        for each in families[family].samples:
            if each.name == family + suffix and all(each.labels.get(k) == v for k, v in labels.items()):
                return each.value
        return None

    mutex_name = 'jobs/"quoted" \\ name'
    checks = [
        (sample("turnstile_hold_seconds", "_count", primitive="mutex", name=mutex_name), 3),
        (sample("turnstile_acquire_wait_seconds", "_count", primitive="mutex", outcome="admitted", name=mutex_name), 3),
        (sample("turnstile_acquire_wait_seconds", "_count", primitive="semaphore", outcome="timed_out", name="pool"), 1),
        (sample("turnstile_acquire_wait_seconds", "_bucket", primitive="semaphore", outcome="admitted", le="+Inf"), 1),
        (sample("turnstile_holds", "", primitive="semaphore", name="pool"), 0),
        (sample("turnstile_connections", "_total", backend="file"), 0),
    ]
    if not problems:
        for number, (found, wanted) in enumerate(checks):
            if found != wanted:
                problems.append(f"check {number}: found {found}, wanted {wanted}")
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
