#!/usr/bin/env python3
"""plot_loss.py LOG.csv [LOG2.csv ...] [--png out.png] [--floor NATS | --floor markov.json]

Loss curves from k2c_train's CSV logs (columns step, loss, val_loss, ...), one line per log and
the validation points on top, so runs of different configurations or parallel layouts can be
compared at a glance. --floor draws a horizontal line at the lowest achievable loss: a number, or
the Markov data's markov.json, whose entropy rate is that floor.
"""
import argparse
import csv
import json
import os
import sys


def read_log(path):
    steps, loss, val_steps, val = [], [], [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            steps.append(int(row["step"]) + 1)
            loss.append(float(row["loss"]))
            if row.get("val_loss"):
                val_steps.append(int(row["step"]) + 1)
                val.append(float(row["val_loss"]))
    return steps, loss, val_steps, val


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--png", default="loss.png")
    ap.add_argument("--floor", help="the lowest achievable loss, drawn as a line: NATS or a markov.json")
    args = ap.parse_args()
    floor = None
    if args.floor:
        if args.floor.endswith(".json"):
            with open(args.floor) as f:
                floor = float(json.load(f)["entropy_rate_nats"])
        else:
            floor = float(args.floor)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_loss.py needs matplotlib (Debian: python3-matplotlib)")
    fig, ax = plt.subplots(figsize=(7, 4))
    for path in args.logs:
        steps, loss, val_steps, val = read_log(path)
        name = os.path.splitext(os.path.basename(path))[0]
        line, = ax.plot(steps, loss, lw=1.2, label=f"{name} (train)")
        if val:
            ax.plot(val_steps, val, "o", color=line.get_color(), ms=4, label=f"{name} (validation)")
    if floor is not None:
        ax.axhline(floor, color="gray", ls="--", lw=1, label=f"floor {floor:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
