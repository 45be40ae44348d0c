#!/usr/bin/env python3
"""Where one training step's GPU time goes, kernel by kernel, from an Nsight Compute CSV.

    ncu --metrics gpu__time_duration.sum --cache-control none --clock-control none --csv \
        --log-file step.csv build/solutions/bin/k2c_capstone --steps 2 ...
    python3 tools/ncu_step.py step.csv [--top 40]

ncu runs every kernel alone, so a kernel's time is its own, without the launch gaps between
kernels or the overlap of kernels on side streams. The step is the last one in the file: the
kernels after the previous step's AdamW kernels up to the last AdamW kernel.
"""
import argparse
import csv
import re
import sys
from collections import defaultdict

UNITS = {"nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0}


def short(name):
    """A kernel's name without its parameters and namespaces (template arguments kept)."""
    name = name.replace("(anonymous namespace)::", "")
    depth = 0
    for i, ch in enumerate(name):  # the parameter list: the first '(' outside template brackets
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0:
            name = name[:i]
            break
    name = re.sub(r"^void ", "", name.strip())
    return re.sub(r"\b[A-Za-z_]\w*::", "", name)


def read(path):
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    rows = []
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        rows.append((row["Kernel Name"], value * UNITS.get(row["Metric Unit"], 1e-9)))
    return rows


def last_step(rows):
    marks = [i for i, (name, _) in enumerate(rows) if "adamw" in name.lower()]
    if not marks:
        sys.exit("ncu_step: no AdamW kernel in the file: not a training run?")
    blocks, start = [], marks[0]
    for a, b in zip(marks, marks[1:]):
        if b - a > 16:
            blocks.append((start, a))
            start = b
    blocks.append((start, marks[-1]))
    if len(blocks) < 2:
        sys.exit("ncu_step: only one step in the file (run two)")
    return rows[blocks[-2][1] + 1: blocks[-1][1] + 1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    step = last_step(read(a.csv))
    total = sum(t for _, t in step)
    by = defaultdict(lambda: [0.0, 0])
    for name, t in step:
        e = by[short(name)]
        e[0] += t
        e[1] += 1
    print(f"one step: {len(step)} kernels, {total * 1e3:.3f} ms of GPU time (each kernel alone)")
    print(f"{'kernel':60s} {'ms':>8s} {'share':>6s} {'calls':>6s}")
    for name, (t, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[: a.top]:
        print(f"{name[:60]:60s} {t * 1e3:8.3f} {t / total:6.1%} {n:6d}")


if __name__ == "__main__":
    main()
