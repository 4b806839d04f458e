#!/usr/bin/env python3
"""Plots the CSVs written by `cuda-peer-bench` (bench/src/).

    python3 bench/plot.py [RESULTS_DIR] [MACHINE]      (defaults: bench/results local)

Reads RESULTS_DIR/MACHINE-allreduce.csv (every collective despite the name)
and, if present, RESULTS_DIR/MACHINE-copy.csv; writes MACHINE-allreduce.png
(per collective and dtype: bus bandwidth and latency against size, log-log,
one line per implementation) and MACHINE-copy.png (GB/s against size, one line per
path, one panel per direction; the line is the mean over GPU pairs and the
band their min..max) next to them. For `mp-allreduce`'s
MACHINE-multiprocess-allreduce.csv, pass MACHINE-multiprocess as MACHINE.
"""

import csv
import os
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

IMPL_ORDER = ["cuda-peer-p2p", "nccl", "cuda-peer-staged", "nccl-no-p2p",
              "cuda-peer-ipc", "nccl-mp", "cuda-peer-nccl", "cuda-peer-ipc-staged", "nccl-mp-no-p2p"]
STYLE = {
    "cuda-peer-p2p": dict(color="tab:blue", linestyle="-", marker="o"),
    "nccl": dict(color="tab:orange", linestyle="-", marker="s"),
    "cuda-peer-staged": dict(color="tab:blue", linestyle="--", marker="o", markerfacecolor="none"),
    "nccl-no-p2p": dict(color="tab:orange", linestyle="--", marker="s", markerfacecolor="none"),
    # mp-allreduce (one process per GPU): the same colours and line styles.
    "cuda-peer-ipc": dict(color="tab:blue", linestyle="-", marker="o"),
    "nccl-mp": dict(color="tab:orange", linestyle="-", marker="s"),
    "cuda-peer-nccl": dict(color="tab:purple", linestyle=":", marker="x"),
    "cuda-peer-ipc-staged": dict(color="tab:blue", linestyle="--", marker="o", markerfacecolor="none"),
    "nccl-mp-no-p2p": dict(color="tab:orange", linestyle="--", marker="s", markerfacecolor="none"),
    "p2p": dict(color="tab:blue", marker="o"),
    "staged": dict(color="tab:green", marker="^"),
    "driver-no-peer": dict(color="tab:red", marker="v"),
}


def human_bytes(x, _pos=None):
    """4, 1K, 16M, 1G: powers of two as nccl-tests users read them."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if x >= scale:
            v = x / scale
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{x:.0f}"


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def order(names, preferred):
    return [n for n in preferred if n in names] + sorted(n for n in names if n not in preferred)


def size_axis(ax):
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(human_bytes))
    ax.grid(True, which="major", alpha=0.3)
    ax.set_xlabel("size (bytes, nccl-tests convention)")


def plot_collectives(rows, machine, out):
    """One row of two panels (busbw, latency) per (collective, dtype)."""
    # (collective, dtype) -> impl -> [(bytes, time_us, busbw, wrong)]
    series = defaultdict(lambda: defaultdict(list))
    for r in rows:
        series[(r["collective"], r["dtype"])][r["impl"]].append(
            (int(r["bytes"]), float(r["time_us"]), float(r["busbw_gbs"]), int(r["wrong"]))
        )
    coll_order = ["all_reduce", "reduce_scatter", "all_gather", "broadcast"]
    dtype_order = ["f32", "bf16"]
    keys = sorted(series, key=lambda k: (coll_order.index(k[0]) if k[0] in coll_order else 99,
                                         dtype_order.index(k[1]) if k[1] in dtype_order else 99, k[1]))
    if not keys:
        print("no collective rows", file=sys.stderr)
        return
    ranks = rows[0]["ranks"]
    fig, axes = plt.subplots(len(keys), 2, figsize=(13, 3.6 * len(keys)), squeeze=False)
    for (coll, dtype), (ax_bw, ax_t) in zip(keys, axes):
        for impl in order(series[(coll, dtype)].keys(), IMPL_ORDER):
            pts = sorted(series[(coll, dtype)][impl])
            xs = [p[0] for p in pts]
            wrong = sum(p[3] for p in pts)
            label = impl + (f" ({wrong} wrong!)" if wrong else "")
            style = STYLE.get(impl, {})
            bw = [(p[0], p[2]) for p in pts if p[2] > 0]  # log axis: drop rounded-to-zero points
            ax_bw.plot([b[0] for b in bw], [b[1] for b in bw], label=label, markersize=3, **style)
            ax_t.plot(xs, [p[1] for p in pts], label=label, markersize=3, **style)
        for ax in (ax_bw, ax_t):
            size_axis(ax)
        ax_bw.set_yscale("log")
        ax_bw.set_ylabel("busbw (GB/s)")
        ax_bw.set_title(f"{coll} {dtype}: bus bandwidth")
        ax_t.set_yscale("log")
        ax_t.set_ylabel("time per call (us)")
        ax_t.set_title(f"{coll} {dtype}: latency")
        ax_bw.legend(fontsize=8)
    fig.suptitle(f"{machine}: collectives, {ranks} ranks")
    save(fig, out)


def save(fig, out):
    """Lays out `fig` under its title, writes it to `out` and says so."""
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(out)


def plot_copies(rows, machine, out):
    """Panels uni and bi; per path, the mean over GPU pairs and their range."""
    # direction -> path -> bytes -> [gbs over pairs]
    series = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in rows:
        series[r["direction"]][r["path"]][int(r["bytes"])].append(float(r["gbs"]))
    dirs = [d for d in ("uni", "bi") if d in series] + sorted(d for d in series if d not in ("uni", "bi"))
    if not dirs:
        print("no copy rows", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, len(dirs), figsize=(6.5 * len(dirs), 4.2), squeeze=False)
    titles = {"uni": "one way", "bi": "both ways at once (GB/s of both directions)"}
    for d, ax in zip(dirs, axes[0]):
        for path in order(series[d].keys(), ["p2p", "staged", "driver-no-peer"]):
            by_size = series[d][path]
            xs = sorted(by_size)
            mean = [sum(by_size[x]) / len(by_size[x]) for x in xs]
            style = STYLE.get(path, {})
            ax.plot(xs, mean, label=path, markersize=3, **style)
            if any(len(by_size[x]) > 1 for x in xs):
                ax.fill_between(xs, [min(by_size[x]) for x in xs], [max(by_size[x]) for x in xs],
                                color=style.get("color"), alpha=0.15, linewidth=0)
        size_axis(ax)
        ax.set_ylabel("GB/s")
        ax.set_title(f"copy, {titles.get(d, d)}")
        ax.legend(fontsize=8)
    fig.suptitle(f"{machine}: copies between GPUs (mean over pairs, band: min..max)")
    save(fig, out)


def main(argv):
    results = argv[1] if len(argv) > 1 else "bench/results"
    machine = argv[2] if len(argv) > 2 else "local"
    coll_csv = os.path.join(results, f"{machine}-allreduce.csv")
    copy_csv = os.path.join(results, f"{machine}-copy.csv")
    found = False
    if os.path.exists(coll_csv):
        plot_collectives(read_csv(coll_csv), machine, os.path.join(results, f"{machine}-allreduce.png"))
        found = True
    if os.path.exists(copy_csv):
        plot_copies(read_csv(copy_csv), machine, os.path.join(results, f"{machine}-copy.png"))
        found = True
    if not found:
        print(f"neither {coll_csv} nor {copy_csv} exists", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
