#!/usr/bin/env python3
"""Decode throughput against batch size, from `k2c_inference --sweep ... -j FILE.json`.

    python3 tools/plot_decode.py sweep.json [more.json ...] --png decode.png

Two panels: the step time and the tokens per second against the batch size (log axes), one line
per file (say the small model on an H200 and the tiny one on a CPU). While the step is bound by
reading the weights its time stays flat and the throughput grows in proportion to the batch; the
bend is where the cache reads or the arithmetic take over (lecture 19, section 2).
"""
import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="JSON files written by k2c_inference --sweep -j")
    ap.add_argument("--png", default="decode.png", help="output image (default decode.png)")
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_decode.py: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return 1
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(11, 4.2))
    for path in args.files:
        try:
            with open(path) as f:
                run = json.load(f)
            rows = sorted(run["rows"], key=lambda r: r["batch"])
        except (OSError, ValueError, KeyError) as e:
            print(f"plot_decode.py: {path}: not a --sweep JSON ({e})", file=sys.stderr)
            return 1
        label = f"{run.get('model', '?')}, context {run.get('context', '?')} ({path})"
        batch = [r["batch"] for r in rows]
        ax_t.plot(batch, [r["step_ms"] for r in rows], "o-", label=label)
        ax_r.plot(batch, [r["tokens_per_s"] for r in rows], "o-", label=label)
    for ax, what in ((ax_t, "decode step (ms)"), (ax_r, "tokens per second")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences per step)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    ax_r.legend(fontsize=8)
    fig.suptitle("Decode: step time and throughput against batch size")
    fig.tight_layout()
    fig.savefig(args.png, dpi=130)
    print(f"plot_decode.py: wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
