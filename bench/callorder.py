#!/usr/bin/env python3
"""Medians of `cuda-peer-bench p2p --after-capture` runs (bench/gpu-evidence.sh
callorder: one CSV per run, {machine}-{path}-{round}-p2p.csv in DIR): per
path, implementation and size, the median time before and after a captured
call over the rounds, after/before (above 1: the order of calls costs that
much), and each side's spread (max/min over its rounds).

    python3 bench/callorder.py DIR
"""
import csv, glob, os, re, statistics, sys
from collections import defaultdict

SUFFIX = "-after-capture"
times = defaultdict(lambda: {"before": [], "after": []})
wrong = 0
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*-p2p.csv"))):
    m = re.match(r".*-(p2p|staged|auto)-\d+-p2p\.csv$", os.path.basename(path))
    if not m:
        continue
    for r in csv.DictReader(open(path)):
        imp, side = (r["impl"][: -len(SUFFIX)], "after") if r["impl"].endswith(SUFFIX) else (r["impl"], "before")
        times[(m.group(1), imp, r["op"], r["dtype"], int(r["ranks"]), int(r["bytes"]))][side].append(float(r["time_us"]))
        wrong += int(r["wrong"])
print(f"{'path':7} {'impl':16} {'op':10} {'dtype':5} {'ranks':>5} {'bytes':>10} {'before us':>10} {'after us':>10} {'ratio':>6} {'spread before':>13} {'spread after':>12} {'rounds':>6}")
for key in sorted(times):
    t = times[key]
    if not t["before"] or not t["after"]:
        continue
    b, a = statistics.median(t["before"]), statistics.median(t["after"])
    spread = lambda xs: max(xs) / min(xs)
    print(f"{key[0]:7} {key[1]:16} {key[2]:10} {key[3]:5} {key[4]:>5} {key[5]:>10} {b:>10.2f} {a:>10.2f} {a / b:>6.2f} {spread(t['before']):>13.2f} {spread(t['after']):>12.2f} {len(t['before']):>6}")
print(f"# wrong elements over every run: {wrong}")
sys.exit(1 if wrong else 0)
