#!/usr/bin/env python3
"""Decode throughput against batch size, from `k2c_inference --sweep ... -j FILE.json`.

    python3 tools/plot_decode.py sweep.json [more.json ...] --png decode.png
    python3 tools/plot_decode.py --roofline autograder/reference/h200.json --png lectures/figures/decode.png

Two panels: the step time and the tokens per second against the batch size (log axes), one line
per file (say the small model on an H200 and the tiny one on a CPU). While the step is bound by
reading the weights its time stays flat and the throughput grows in proportion to the batch; the
bend is where the cache reads or the arithmetic take over (lecture 19, section 2).

--roofline draws instead what a reference file records under inference.decode_roofline (module
19's benchmark k2c_bench_19_inference): one layer of an 8B-class model, its weights' GEMM and its
decode attention timed apart against the batch size, beside the floors the copy rate and the
bf16 GEMM rate of the same run put under them.
"""
import argparse
import json
import sys

import k2c_tools


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", help="JSON files written by k2c_inference --sweep -j")
    ap.add_argument("--roofline", metavar="REFERENCE_JSON", help="draw inference.decode_roofline of this file")
    ap.add_argument("--png", default="decode.png", help="output image (default decode.png)")
    args = ap.parse_args()
    if bool(args.files) == bool(args.roofline):
        ap.error("give sweep files or --roofline REFERENCE_JSON, one of the two")
    plt = k2c_tools.pyplot("plot_decode.py")
    if plt is None:
        return 1
    if args.roofline:
        return roofline(plt, args.roofline, args.png)
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
    return finish(fig, ((ax_t, "decode step (ms)"), (ax_r, "tokens per second")),
                  "Decode: step time and throughput against batch size", args.png)


def finish(fig, axes, title, png):
    """Log-log axes over the batch size, each with its label and legend; the figure saved."""
    for ax, what in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences per step)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=130)
    print(f"plot_decode.py: wrote {png}")
    return 0


def roofline(plt, path, png):
    try:
        with open(path) as f:
            r = json.load(f)["inference"]["decode_roofline"]
        rows = sorted(r["rows"], key=lambda x: x["batch"])
        params, copy, peak = r["parameters"], r["copy_gbs"], r["bf16_tflops"]
    except (OSError, ValueError, KeyError) as e:
        print(f"plot_decode.py: {path}: no inference.decode_roofline ({e})", file=sys.stderr)
        return 1
    batch = [x["batch"] for x in rows]
    w = [x["weights_ms"] for x in rows]
    a = [x["attention_ms"] for x in rows]
    step = [x + y for x, y in zip(w, a)]
    read_floor = 2 * params / (copy * 1e9) * 1e3                  # bf16 weights once, at the copy rate
    math_floor = [2 * params * b / (peak * 1e12) * 1e3 for b in batch]
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax_t.plot(batch, w, "o-", label="weights: one bf16 GEMM (cuBLAS)")
    ax_t.plot(batch, a, "s-", label="attention: Part G's kernel")
    ax_t.plot(batch, step, "k^-", label="the step: both")
    ax_t.plot(batch, [max(read_floor, m) for m in math_floor], "--", color="gray",
              label="weights' floor: max(bytes / copy rate, FLOPs / GEMM rate)")
    ax_r.plot(batch, [1e3 * b / t for b, t in zip(batch, step)], "k^-", label="measured")
    ax_r.plot(batch, [1e3 * b / max(read_floor, m) for b, m in zip(batch, math_floor)], "--", color="gray",
              label="weights' floor alone")
    return finish(fig, ((ax_t, "time per layer and step (ms)"), (ax_r, "tokens per second, one layer")),
                  f"Decode on {r.get('gpu', 'a GPU')}: {r.get('model', '')}, {r.get('context', '?')} cached tokens", png)


if __name__ == "__main__":
    sys.exit(main())
