# SPDX-License-Identifier: Apache-2.0
"""The PNG plots of bench/report.py (Debian's python3-matplotlib, Agg backend: no display)."""
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from report import BACKENDS, TURNSTILE, rate  # noqa: E402

LABELS = dict(BACKENDS)


def save(figure, directory, name):
    figure.tight_layout()
    figure.savefig(os.path.join(directory, name), dpi=90)
    plt.close(figure)


def finish(axis, xlabel, ylabel, title, legend_at):
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.grid(True, which="both", alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=7, loc=legend_at)
    axis.set_title(title, fontsize=10)


def uncontended(results, directory):
    sections = [(k, results["uncontended"][k]) for k, _ in BACKENDS if k in results["uncontended"]]
    if not sections:
        return
    figure, axes = plt.subplots(1, len(sections), figsize=(3.0 * len(sections), 5.2), squeeze=False)
    for axis, (key, section) in zip(axes[0], sections):
        names = section["order"]
        values = [rate(section, n) or 0 for n in names]
        colors = ["tab:red" if n == TURNSTILE else "tab:gray" if n == section["limit"] else "tab:blue" for n in names]
        axis.bar(range(len(names)), values, color=colors)
        axis.set_xticks(range(len(names)))
        axis.set_xticklabels([n.replace(" (limit)", "\n(limit)") for n in names], rotation=60, ha="right", fontsize=7)
        axis.set_title(LABELS[key], fontsize=9)
    axes[0][0].set_ylabel("lock+unlock pairs/s (higher is better)")
    figure.suptitle("Uncontended: turnstile (red), peers (blue), raw limit (gray)", fontsize=10)
    save(figure, directory, "uncontended.png")


def throughput(results, directory):
    figure, axis = plt.subplots(figsize=(7.5, 4.5))
    for key, label in BACKENDS:
        for mode, runs in results["contention"].get(key, {}).items():
            points = sorted((int(n), r["per_second"]) for n, r in runs.items() if r.get("per_second"))
            if points:
                style = "-o" if mode == "turnstile" else "--s"
                axis.plot(*zip(*points), style, label=f"{label} {mode}")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xticks([1, 2, 4, 8, 16, 32])
    axis.set_xticklabels(["1", "2", "4", "8", "16", "32"])
    finish(axis, "processes contending for one Mutex", "acquisitions/s", "Throughput against contenders", "best")
    save(figure, directory, "throughput.png")


def handoff_cdf(results, directory):
    figure, axis = plt.subplots(figsize=(7.5, 4.5))
    for key, label in BACKENDS:
        for mode, quantiles in results["cdf"].get(key, {}).items():
            if quantiles:
                axis.plot([q / 1e3 for q in quantiles], [i / (len(quantiles) - 1) for i in range(len(quantiles))],
                          label=f"{label} {mode}")
    axis.set_xscale("log")
    finish(axis, "handoff to another process, µs (log)", "fraction of handoffs", "Handoff latency CDF, 8 contenders",
           "lower right")
    save(figure, directory, "handoff_cdf.png")


def cli(results, directory):
    rows = [(f"{k}:// {name}", r["median_ms"]) for k in ("file", "etcd") for name, r in (results["cli"].get(k) or {}).items()]
    if not rows:
        return
    figure, axis = plt.subplots(figsize=(6.5, 3))
    axis.barh([r[0] for r in rows], [r[1] for r in rows],
              color=["tab:red" if "turnstile" in r[0] else "tab:blue" for r in rows])
    axis.set_xlabel("median wall time of one run, ms (lower is better)")
    axis.invert_yaxis()
    axis.set_title("CLI start-up, hyperfine", fontsize=10)
    save(figure, directory, "cli.png")


def growth(results, directory):
    panels = [("holds", "lock_us_per_hold", "µs per lock()", "names held at once"),
              ("holds", "kib_per_hold", "RSS KiB per hold", "names held at once"),
              ("waiters", "handoff_us", "µs per handoff while draining", "waiters on one name"),
              ("waiters", "kib_per_waiter", "RSS KiB per waiter (thread excluded)", "waiters on one name")]
    figure, axes = plt.subplots(2, 2, figsize=(9, 6.5))
    for axis, (kind, field, ylabel, xlabel) in zip(axes.flat, panels):
        for key, label in BACKENDS:
            runs = results["growth"].get(key, {}).get(kind, {})
            points = sorted((int(n), r[field]) for n, r in runs.items() if r.get(field) is not None)
            if points:
                axis.plot(*zip(*points), "-o", label=label)
        axis.set_xscale("log")
        if field.endswith("_us") or field.endswith("_us_per_hold"):
            axis.set_yscale("log")
        axis.set_xlabel(xlabel)
        axis.set_ylabel(ylabel, fontsize=8)
        axis.grid(True, which="both", alpha=0.3)
    if axes[0][0].get_legend_handles_labels()[0]:
        axes[0][0].legend(fontsize=7)
    figure.suptitle("Growth", fontsize=10)
    save(figure, directory, "growth.png")


def draw(results, directory):
    os.makedirs(directory, exist_ok=True)
    for plot in (uncontended, throughput, handoff_cdf, cli, growth):
        plot(results, directory)
