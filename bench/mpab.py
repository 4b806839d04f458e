#!/usr/bin/env python3
"""Medians of side-by-side runs of two or more builds of cuda-peer-bench,
one CSV per run in OUT/SIDE-K/ or OUT/SIDE-rN-K/ (bench/mpab.sh's
mp-allreduce runs, or p2p runs of N ranks): per build other than prev,
impl, call, dtype, ranks and size, the median time of prev and of the
build and build/prev (below 1: the build is faster), with each one's
spread (max/min over its runs)."""
import csv, glob, os, re, statistics, sys
from collections import defaultdict

out = sys.argv[1]
times = defaultdict(lambda: defaultdict(list))
wrong = 0
sides = set()
for path in glob.glob(os.path.join(out, "*-*", "*.csv")):
    side = re.sub(r"(-r\d+)?-\d+$", "", os.path.basename(os.path.dirname(path)))
    sides.add(side)
    for r in csv.DictReader(open(path)):
        call = r.get("collective") or r["op"]
        times[(r["impl"], call, r["dtype"], int(r["ranks"]), int(r["bytes"]))][side].append(float(r["time_us"]))
        wrong += int(r["wrong"])
for side in sorted(sides - {"prev"}, key=lambda s: (s != "new", s)):
    print(f"# {side} against prev")
    print(f"{'impl':22} {'call':10} {'dtype':5} {'ranks':>5} {'bytes':>11} {'prev us':>10} {side + ' us':>10} {'ratio':>8} {'spread prev':>11} {'spread ' + side:>10}")
    for key in sorted(times):
        t = times[key]
        if not t["prev"] or not t[side]:
            continue
        p, n = statistics.median(t["prev"]), statistics.median(t[side])
        sp = max(t["prev"]) / min(t["prev"])
        sn = max(t[side]) / min(t[side])
        print(f"{key[0]:22} {key[1]:10} {key[2]:5} {key[3]:>5} {key[4]:>11} {p:>10.2f} {n:>10.2f} {n / p:>8.3f} {sp:>11.3f} {sn:>10.3f}")
print(f"wrong elements over every run: {wrong}")
