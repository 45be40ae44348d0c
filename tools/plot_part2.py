#!/usr/bin/env python3
"""Draw one benchmark of modules 13, 14, 16 or 17 from its JSON summary.

    python3 tools/plot_part2.py RUN.json [--png out.png]

RUN.json is what the benchmark wrote with -o (tools/gpu-check.sh keeps them in part2.tar.gz on a
machine with two GPUs); which benchmark it is, the file says by its fields:
  k2c_zero               memory of the training state per rank by configuration (stacked:
                         parameters, gradients, optimizer, communication buffers), the ideal
                         marked, each bar labelled with its step time
  k2c_tensor_parallel    the parallel MLP's speed-up over one GPU against the width d, beside the
                         ideal (the number of ranks)
  k2c_sequence_parallel  ring attention's rate per GPU over the one-GPU rate, against the sequence
  k2c_expert_parallel    dispatch + combine's bus bandwidth beside the library's all-to-all on the
                         same rows, against the tokens per rank
The default output is RUN.png beside the input.
"""
import argparse
import json
import pathlib
import sys

import k2c_tools


def kind_of(run):
    """Which benchmark wrote the summary, from the fields of its rows."""
    rows = run.get("rows")
    if not isinstance(rows, list) or not rows or not isinstance(rows[0], dict):
        return None
    keys = set(rows[0])
    for kind, needed in (("zero", {"config", "params", "grads", "optimizer", "step_ms"}),
                         ("tensor_parallel", {"d", "scaling"}),
                         ("sequence_parallel", {"seq_len", "ratio"}),
                         ("expert_parallel", {"tokens", "ep_gbs", "lib_gbs"})):
        if needed <= keys:
            return kind
    return None


def title(run, what):
    return f"{what}: {run.get('ranks', '?')} ranks, {run.get('backend', '?')} backend"


def zero(ax, run):
    rows = run["rows"]
    mib = 1 / 1048576
    names = [r["config"] for r in rows]
    bottom = [0.0] * len(rows)
    for part in ("params", "grads", "optimizer", "comm"):
        values = [r[part] * mib for r in rows]
        ax.bar(names, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    if all("ideal" in r for r in rows):
        ax.scatter(names, [r["ideal"] * mib for r in rows], marker="_", s=400, color="black", label="ideal", zorder=3)
    for x, (total, r) in enumerate(zip(bottom, rows)):
        ax.annotate(f"{r['step_ms']:.1f} ms", (x, total), ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, max(bottom) * 1.35)  # room for the step times and the legend
    ax.set_ylabel("training state per rank, MiB")
    ax.set_title(title(run, "ZeRO: memory per rank, step time on each bar"), fontsize=10)
    ax.legend(fontsize=8, ncol=5, loc="upper center")


def against(ax, run, x, series, xlabel, ylabel, what, ideal=None):
    """Each (label, style, field) of series against the rows' field x on a log2 axis, and a dashed
    line at ideal = (value, label) where given."""
    rows = run["rows"]
    for label, style, field in series:
        ax.plot([r[x] for r in rows], [r[field] for r in rows], style, label=label)
    if ideal:
        ax.axhline(ideal[0], color="gray", ls="--", label=ideal[1])
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title(run, what))


def tensor_parallel(ax, run):
    against(ax, run, "d", [("measured speed-up", "o-", "scaling")], "model width d", "speed-up over one GPU",
            "Tensor-parallel MLP", (run.get("ranks", 1), "ideal (the ranks)"))


def sequence_parallel(ax, run):
    against(ax, run, "seq_len", [("ring attention", "o-", "ratio")], "sequence length", "rate per GPU over one GPU's",
            "Ring attention", (1.0, "the one-GPU rate"))


def expert_parallel(ax, run):
    against(ax, run, "tokens", [("dispatch + combine", "o-", "ep_gbs"),
                                ("the library's all-to-all, same rows", "s--", "lib_gbs")],
            "tokens per rank", "bus bandwidth, GB/s", "Expert-parallel exchange")


DRAW = {"zero": zero, "tensor_parallel": tensor_parallel, "sequence_parallel": sequence_parallel,
        "expert_parallel": expert_parallel}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=pathlib.Path, help="a benchmark's JSON summary (its -o file)")
    ap.add_argument("--png", type=pathlib.Path, help="output image (default: the input with .png)")
    args = ap.parse_args()
    try:
        run = json.loads(args.run.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"plot_part2.py: cannot read {args.run}: {e}", file=sys.stderr)
        return 1
    kind = kind_of(run) if isinstance(run, dict) else None
    if kind is None:
        print(f"plot_part2.py: {args.run} is not the summary of k2c_zero, k2c_tensor_parallel, "
              "k2c_sequence_parallel or k2c_expert_parallel (no rows with their fields)", file=sys.stderr)
        return 1
    plt = k2c_tools.pyplot("plot_part2.py")
    if plt is None:
        return 1
    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        DRAW[kind](ax, run)
    except (KeyError, TypeError) as e:
        print(f"plot_part2.py: {args.run}: a row lacks a field of {kind}'s summary ({e})", file=sys.stderr)
        return 1
    ax.grid(alpha=0.3)
    if ax.get_legend() is None:
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = args.png or args.run.with_suffix(".png")
    fig.savefig(out, dpi=120)
    print(f"plot_part2.py: wrote {out} ({kind})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
