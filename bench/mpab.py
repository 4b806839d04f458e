#!/usr/bin/env python3
"""Medians of bench/mpab.sh's runs: per impl, dtype and size, the median
time of each build and new/prev (below 1: the new build is faster), with
each build's spread (max/min over its runs)."""
import csv, glob, os, statistics, sys
from collections import defaultdict

out = sys.argv[1]
times = defaultdict(lambda: defaultdict(list))
wrong = 0
for side in ("prev", "new"):
    for path in glob.glob(os.path.join(out, f"{side}-*", "*.csv")):
        for r in csv.DictReader(open(path)):
            times[(r["impl"], r["dtype"], int(r["bytes"]))][side].append(float(r["time_us"]))
            wrong += int(r["wrong"])
print(f"{'impl':22} {'dtype':5} {'bytes':>11} {'prev us':>10} {'new us':>10} {'new/prev':>8} {'spread prev':>11} {'spread new':>10}")
for key in sorted(times):
    t = times[key]
    if not t["prev"] or not t["new"]:
        continue
    p, n = statistics.median(t["prev"]), statistics.median(t["new"])
    sp = max(t["prev"]) / min(t["prev"])
    sn = max(t["new"]) / min(t["new"])
    print(f"{key[0]:22} {key[1]:5} {key[2]:>11} {p:>10.2f} {n:>10.2f} {n / p:>8.3f} {sp:>11.3f} {sn:>10.3f}")
print(f"wrong elements over every run: {wrong}")
