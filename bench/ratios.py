#!/usr/bin/env python3
"""Ratios of cuda-peer to NCCL from a benchmark CSV (one run, one machine).

    python3 bench/ratios.py bench/results/2026-11-30-h200x2-sweep-a52465c/h200x2-allreduce.csv [collective]

For each dtype and size: latency ratio (cuda-peer / NCCL, < 1 is faster) and
busbw ratio (cuda-peer / NCCL, > 1 is faster), for P2P against nccl and for
the staged path against nccl-no-p2p (for `mp-allreduce`'s CSV:
cuda-peer-ipc against nccl-mp, cuda-peer-ipc-staged against nccl-mp-no-p2p).
Also prints the total #wrong.
"""
import csv
import sys


def main():
    path = sys.argv[1]
    coll = sys.argv[2] if len(sys.argv) > 2 else "all_reduce"
    rows = list(csv.DictReader(open(path)))
    wrong = sum(int(r["wrong"]) for r in rows)
    by = {(r["impl"], r["collective"], r["dtype"], int(r["bytes"])): r for r in rows}
    dtypes = sorted({r["dtype"] for r in rows if r["collective"] == coll})
    sizes = sorted({int(r["bytes"]) for r in rows if r["collective"] == coll})
    impls = {r["impl"] for r in rows}
    if impls & {"cuda-peer-ipc", "nccl-mp", "cuda-peer-ipc-staged", "nccl-mp-no-p2p"}:
        pairs = (("cuda-peer-ipc", "nccl-mp"), ("cuda-peer-ipc-staged", "nccl-mp-no-p2p"))
    else:
        pairs = (("cuda-peer-p2p", "nccl"), ("cuda-peer-staged", "nccl-no-p2p"))
    print(f"{coll}: total #wrong over all {len(rows)} rows: {wrong}")
    print(f"{'dtype':>5} {'bytes':>11} | {'p2p us':>8} {'nccl us':>8} {'t':>5} {'bw':>5} | {'stg us':>8} {'nop2p us':>8} {'t':>5} {'bw':>5}")
    for d in dtypes:
        for b in sizes:
            cells = []
            for ours, theirs in pairs:
                a, n = by.get((ours, coll, d, b)), by.get((theirs, coll, d, b))
                if a and n:
                    ta, tn = float(a["time_us"]), float(n["time_us"])
                    ba, bn = float(a["busbw_gbs"]), float(n["busbw_gbs"])
                    cells.append(f"{ta:8.2f} {tn:8.2f} {ta / tn:5.2f} {ba / bn if bn else 0:5.2f}")
                else:
                    cells.append(f"{'-':>8} {'-':>8} {'-':>5} {'-':>5}")
            print(f"{d:>5} {b:>11} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
