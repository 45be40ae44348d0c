#!/usr/bin/env python3
"""Draw module 12's bucket-size sweep: the data-parallel step time against the bucket size, with
the step without communication (the ceiling) and the naive one-all-reduce-per-parameter step as
horizontal lines.

    tools/plot_ddp.py RESULT.json [MORE.json ...] [--png lectures/figures/ddp_buckets.png]

Each RESULT.json is what `k2c_data_parallel -o RESULT.json` writes (one backend, one rank count);
several files (say 2 and 4 GPUs) become several curves on one plot. The numbers are printed as a
table too, so the script is useful without matplotlib.
"""
import argparse
import json
import pathlib


def label_of(run):
    return f"{run['ranks']} rank(s), {run['backend']}"


ap = argparse.ArgumentParser()
ap.add_argument("results", nargs="+")
ap.add_argument("--png", default="lectures/figures/ddp_buckets.png")
args = ap.parse_args()

runs = []
for path in args.results:
    try:
        runs.append(json.loads(pathlib.Path(path).read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"{path}: {e}")

for run in runs:
    print(f"\n{run['model']}; {label_of(run)}, {run['rows_per_rank']} sequence(s) per rank")
    print(f"{'variant':10s} {'bucket bytes':>14s} {'buckets':>8s} {'step ms':>10s} {'tokens/s/rank':>14s} {'of no_sync':>11s}")
    for r in run["results"]:
        print(f"{r['variant']:10s} {r['bucket_bytes']:>14d} {r['buckets']:>8d} {r['step_ms']:>10.3f} "
              f"{r['tokens_per_s']:>14.0f} {r['ratio']:>11.3f}")

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    raise SystemExit("matplotlib not installed: table only")

fig, ax = plt.subplots(figsize=(8, 4.5))
for k, run in enumerate(runs):
    color = f"C{k}"
    bucketed = sorted((r["bucket_bytes"], r["step_ms"]) for r in run["results"] if r["variant"] == "bucketed")
    if bucketed:
        ax.plot([b / 2**20 for b, _ in bucketed], [ms for _, ms in bucketed], "o-", color=color,
                label=f"bucketed, {label_of(run)}")
    for r in run["results"]:
        if r["variant"] == "no_sync":
            ax.axhline(r["step_ms"], color=color, linestyle="--", linewidth=1, label=f"no sync, {label_of(run)}")
        elif r["variant"] == "naive":
            ax.axhline(r["step_ms"], color=color, linestyle=":", linewidth=1, label=f"naive, {label_of(run)}")
ax.set_xscale("log")
ax.set_xlabel("bucket size (MiB)")
ax.set_ylabel("step time (ms, slowest rank, median)")
ax.set_title(runs[0]["model"], fontsize=9)
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8)
fig.tight_layout()
pathlib.Path(args.png).parent.mkdir(parents=True, exist_ok=True)
fig.savefig(args.png, dpi=120)
print(f"\nwrote {args.png}")
