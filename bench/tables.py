#!/usr/bin/env python3
"""The measured tables of README.md and docs/*.md, generated from bench/results.

    python3 bench/tables.py            # rewrite every table in place
    python3 bench/tables.py --check    # exit 1 if a table differs from what the CSVs give
    python3 bench/tables.py --list     # the table names and the results they read

A table lives between two marker comments:

    <!-- table:allreduce-h200x2 -->
    ...generated...
    <!-- /table -->

Each table reads bench/results/<benchmark>/<machine>/ (the CSV and meta.json of
that benchmark's current run) and ends with a line naming its data. --check also
checks that README.md links only to files that exist under docs/ (the README
ships in the crate, bench/ does not). Standard library only.
"""

import csv
import difflib
import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
# Below this size a point is shown as time per call, from it as busbw.
TIME_BELOW = 16 * MIB


def results(benchmark, machine="h200x2"):
    return os.path.join(RESULTS, benchmark, machine)


def meta(benchmark, machine="h200x2"):
    with open(os.path.join(results(benchmark, machine), "meta.json")) as f:
        return json.load(f)


def rows(benchmark, name, machine="h200x2"):
    with open(os.path.join(results(benchmark, machine), name), newline="") as f:
        return list(csv.DictReader(f))


def size(n):
    for unit, div in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def gbs(x):
    return f"{x:.0f} GB/s" if x >= 100 else f"{x:.1f} GB/s"


def point(index, impl, dtype, nbytes, collective="all_reduce"):
    try:
        return index[(impl, collective, dtype, nbytes)]
    except KeyError:
        raise SystemExit(f"tables.py: no point {impl} {collective} {dtype} {nbytes} B in the CSV") from None


def indexed(data):
    return {(r["impl"], r["collective"], r["dtype"], int(r["bytes"])): r for r in data}


def perf(r):
    """Time per call below TIME_BELOW, busbw from there."""
    if int(r["bytes"]) < TIME_BELOW:
        return f"{float(r['time_us']):.1f} us"
    return gbs(float(r["busbw_gbs"]))


def speedup(ours, theirs):
    """How many times faster `ours` is: their time over ours (= our busbw over theirs)."""
    return f"{float(theirs['time_us']) / float(ours['time_us']):.2f}x"


def table(header, body):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in body]
    return out


def source(benchmark, extra=""):
    m = meta(benchmark)
    machine = m["machine"].split(":")[0]
    parts = [machine, "driver " + m["driver"].split(" ")[0]]
    if "nccl" in m:
        parts.append("NCCL " + m["nccl"])
    return [f"", f"<sub>{', '.join(parts)}{extra}; data: `bench/results/{benchmark}/h200x2/` (meta.json: command, commit, date).</sub>"]


SIZES = [4 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, 1 * GIB]
SHORT = [4 * KIB, 256 * KIB, 1 * MIB, 16 * MIB, 256 * MIB, 1 * GIB]


def versus(benchmark, csvname, pairs, dtypes, sizes, collective="all_reduce", extra_cols=None):
    """One row per (dtype, size): for each (ours, theirs) pair, both and the speed-up."""
    ix = indexed(rows(benchmark, csvname))
    header = (["dtype"] if len(dtypes) > 1 else []) + ["size"]
    for label_ours, label_theirs, _, _ in pairs:
        header += [label_ours, label_theirs, "speed-up"]
    if extra_cols:
        header += [c[0] for c in extra_cols]
    body = []
    for dt in dtypes:
        for n in sizes:
            row = ([dt] if len(dtypes) > 1 else []) + [size(n)]
            for _, _, ours, theirs in pairs:
                a, b = point(ix, ours, dt, n, collective), point(ix, theirs, dt, n, collective)
                row += [perf(a), perf(b), speedup(a, b)]
            if extra_cols:
                row += [c[1](ix, dt, n) for c in extra_cols]
            body.append(row)
    return table(header, body)


IN_PROCESS = [
    ("cuda-peer, P2P", "NCCL", "cuda-peer-p2p", "nccl"),
    ("cuda-peer, P2P off", "NCCL, P2P off", "cuda-peer-staged", "nccl-no-p2p"),
]
BETWEEN_PROCESSES = [
    ("cuda-peer (`ipc::Comm`)", "NCCL", "cuda-peer-ipc", "nccl-mp"),
    ("cuda-peer, staged", "NCCL, P2P off", "cuda-peer-ipc-staged", "nccl-mp-no-p2p"),
]


def allreduce_short():
    return versus("allreduce", "h200x2-allreduce.csv", IN_PROCESS, ["f32"], SHORT) + source("allreduce", ", f32, one process, one rank per GPU")


def allreduce_full():
    return versus("allreduce", "h200x2-allreduce.csv", IN_PROCESS, ["f32", "bf16"], SIZES) + source("allreduce")


def multiprocess_short():
    return versus("multiprocess", "h200x2-multiprocess-allreduce.csv", BETWEEN_PROCESSES[:1], ["f32"], SHORT) + source(
        "multiprocess", ", f32, one process per GPU")


def nccl_path(ix, dt, n):
    # cuda-peer's NCCL path (ipc::NcclComm) against NCCL called directly: time over time.
    a, b = point(ix, "cuda-peer-nccl", dt, n), point(ix, "nccl-mp", dt, n)
    return f"{float(a['time_us']) / float(b['time_us']):.3f}"


def multiprocess_full():
    return versus("multiprocess", "h200x2-multiprocess-allreduce.csv", BETWEEN_PROCESSES, ["f32", "bf16"], SIZES,
                  extra_cols=[("`NcclComm` / NCCL time", nccl_path)]) + source("multiprocess")


def graph():
    return versus("graph", "h200x2-graph-allreduce.csv", IN_PROCESS, ["f32", "bf16"],
                  [4 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 256 * MIB, 1 * GIB]) + source(
        "graph", ", every call replayed from a CUDA graph")


def collectives():
    ix = indexed(rows("collectives", "h200x2-allreduce.csv"))
    header = ["collective", "size"]
    for label_ours, label_theirs, _, _ in IN_PROCESS:
        header += [label_ours, label_theirs, "speed-up"]
    body = []
    for coll in ("reduce_scatter", "all_gather", "broadcast"):
        for n in (4 * KIB, 1 * MIB, 16 * MIB, 256 * MIB):
            row = [coll, size(n)]
            for _, _, ours, theirs in IN_PROCESS:
                a, b = point(ix, ours, "f32", n, coll), point(ix, theirs, "f32", n, coll)
                row += [perf(a), perf(b), speedup(a, b)]
            body.append(row)
    return table(header, body) + source("collectives", ", f32; `bytes` as nccl-tests count them (bench/README.md)")


ALGORITHMS = [
    ("one-shot (P2P)", "cuda-peer-oneshot", "p2p"),
    ("mesh (P2P)", "cuda-peer-mesh", "p2p"),
    ("ring (P2P)", "cuda-peer-ring", "p2p"),
    ("one-shot (host memory)", "cuda-peer-host-oneshot", "host"),
    ("staged ring", "cuda-peer-staged-ring", "host"),
]


def algorithms():
    ix = indexed(rows("algorithms", "h200x2-algos-allreduce.csv"))
    body = []
    for n in (4 * KIB, 1 * MIB, 4 * MIB, 8 * MIB, 16 * MIB, 64 * MIB, 128 * MIB, 256 * MIB, 1 * GIB):
        pts = [point(ix, impl, "f32", n) for _, impl, _ in ALGORITHMS]
        cells = [perf(p) for p in pts]
        for group in ("p2p", "host"):
            members = [i for i, a in enumerate(ALGORITHMS) if a[2] == group]
            best = min(members, key=lambda i: float(pts[i]["time_us"]))
            cells[best] = f"**{cells[best]}**"
        body.append([size(n)] + cells)
    return table(["size"] + [a[0] for a in ALGORITHMS], body) + source(
        "algorithms", ", f32, each algorithm forced; bold: the fastest with P2P and without")


def copies():
    data = rows("copy", "h200x2-copy.csv")
    ix = {(r["path"], r["src"], r["dst"], r["direction"], int(r["bytes"])): float(r["gbs"]) for r in data}
    sizes = [1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, 1 * GIB]

    def get(path, src, dst, direction, n):
        try:
            return ix[(path, src, dst, direction, n)]
        except KeyError:
            raise SystemExit(f"tables.py: no copy point {path} {src}->{dst} {direction} {n} B") from None

    body = []
    for label, path in (("P2P (`Link`, verified)", "p2p"), ("staged (`Link`)", "staged"), ("driver, no peer access", "driver-no-peer")):
        body.append([label] + [f"{get(path, '0', '1', 'uni', n):.1f}" for n in sizes])
    for label, direction in (("staged / driver, one way", "uni"), ("staged / driver, both ways at once", "bi")):
        body.append([label] + [f"{get('staged', '0', '1', direction, n) / get('driver-no-peer', '0', '1', direction, n):.2f}x" for n in sizes])
    return table(["GPU 0 -> 1, GB/s"] + [size(n) for n in sizes], body) + source(
        "copy", ", copies back to back")


def coldstart():
    data = rows("coldstart", "coldstart.csv")
    ix = {(r["kernels"], r["cache"], r["dtype"]): float(r["wall_s"]) for r in data}
    dtypes = ["f32", "bf16", "i8"]
    labels = [
        ("cubins, empty JIT cache", "cubin", "cold"),
        ("cubins, warm cache", "cubin", "warm"),
        ("PTX forced, every module at group creation, empty cache", "ptx", "cold"),
        ("PTX forced, every module at group creation, warm cache", "ptx", "warm"),
        ("PTX forced, `lazy_kernels`, empty cache", "ptx-lazy", "cold"),
    ]
    body = [[label] + [f"{ix[(k, c, dt)]:.2f} s" for dt in dtypes] for label, k, c in labels]
    return table(["whole process, `ring_allreduce --bytes 4096 --iters 1`"] + dtypes, body) + source("coldstart")


def repeat():
    data = rows("allreduce-repeat", "h200x2-repeat-allreduce.csv")
    by = {}
    for r in data:
        impl, proc = re.match(r"(.*)\((process\d+)\)$", r["impl"]).groups()
        by.setdefault(proc, {}).setdefault(impl, {})[(r["dtype"], int(r["bytes"]))] = float(r["time_us"])
    body = []
    for proc in sorted(by):
        p = by[proc]
        cells = []
        for ours, theirs in (("cuda-peer-p2p", "nccl"), ("cuda-peer-staged", "nccl-no-p2p")):
            keys = sorted(p[ours])
            a = [p[ours][k] for k in keys]
            b = [p[theirs][k] for k in keys]
            ratio = [y / x for x, y in zip(a, b)]
            cells += [f"{min(a):.1f}-{max(a):.1f} us", f"{min(b):.1f}-{max(b):.1f} us", f"{min(ratio):.2f}-{max(ratio):.2f}x"]
        body.append([proc] + cells)
    header = ["process", "cuda-peer, P2P", "NCCL", "speed-up", "cuda-peer, P2P off", "NCCL, P2P off", "speed-up"]
    return table(header, body) + source("allreduce-repeat", ", f32 and bf16 at 4-256 KiB, three processes in a row")


TABLES = {
    "allreduce-h200x2-short": (allreduce_short, "allreduce"),
    "allreduce-h200x2": (allreduce_full, "allreduce"),
    "multiprocess-h200x2-short": (multiprocess_short, "multiprocess"),
    "multiprocess-h200x2": (multiprocess_full, "multiprocess"),
    "graph-h200x2": (graph, "graph"),
    "collectives-h200x2": (collectives, "collectives"),
    "algorithms-h200x2": (algorithms, "algorithms"),
    "copy-h200x2": (copies, "copy"),
    "coldstart-h200x2": (coldstart, "coldstart"),
    "allreduce-repeat-h200x2": (repeat, "allreduce-repeat"),
}

MARKER = re.compile(r"^<!-- table:([a-z0-9-]+) -->\n(.*?)^<!-- /table -->$", re.S | re.M)


def documents():
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def render(text, path):
    errors = []

    def one(m):
        name = m.group(1)
        if name not in TABLES:
            errors.append(f"{os.path.relpath(path, ROOT)}: unknown table {name!r} (known: {', '.join(TABLES)})")
            return m.group(0)
        return f"<!-- table:{name} -->\n" + "\n".join(TABLES[name][0]()) + "\n<!-- /table -->"

    out = MARKER.sub(one, text)
    opened = len(re.findall(r"^<!-- table:", text, re.M))
    if opened != len(MARKER.findall(text)):
        errors.append(f"{os.path.relpath(path, ROOT)}: a `<!-- table:NAME -->` without its `<!-- /table -->`")
    return out, errors


def readme_links():
    """README.md ships in the crate: its relative links may only name files under docs/."""
    errors = []
    text = open(os.path.join(ROOT, "README.md")).read()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://|#|mailto:", target):
            continue
        path = target.split("#")[0]
        if not path.startswith("docs/") or not os.path.isfile(os.path.join(ROOT, path)):
            errors.append(f"README.md: link to {target!r}: only files under docs/ that exist (bench/ is not in the crate)")
    return errors


def main(argv):
    if "--list" in argv:
        for name, (_, bench) in TABLES.items():
            print(f"{name:28} bench/results/{bench}/h200x2/")
        return 0
    check = "--check" in argv
    errors, stale, used = [], [], set()
    for path in documents():
        text = open(path).read()
        used.update(MARKER_NAME.findall(text))
        new, errs = render(text, path)
        errors += errs
        if new != text:
            if check:
                stale.append(path)
                sys.stdout.writelines(difflib.unified_diff(
                    text.splitlines(True), new.splitlines(True), os.path.relpath(path, ROOT), "generated"))
            else:
                with open(path, "w") as f:
                    f.write(new)
                print(f"updated {os.path.relpath(path, ROOT)}")
    if check:
        errors += readme_links()
    for e in errors:
        print(e, file=sys.stderr)
    if stale:
        print("tables.py: tables differ from bench/results in: " + ", ".join(os.path.relpath(p, ROOT) for p in stale)
              + " (run python3 bench/tables.py)", file=sys.stderr)
    if errors or stale:
        return 1
    if check:
        print(f"tables.py: {len(used)} tables match bench/results")
    return 0


MARKER_NAME = re.compile(r"^<!-- table:([a-z0-9-]+) -->", re.M)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
