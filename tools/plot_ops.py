#!/usr/bin/env python3
"""Where one training step's time goes, operation by operation, for one run or several side by side.

    python3 tools/plot_ops.py run.json [other.json ...] --png ops.png
    python3 tools/plot_ops.py --reference autograder/reference/h200.json \\
        "capstone/dense-135m" "capstone/dense-135m course" --labels trusted course \\
        --png lectures/figures/capstone_ops.png

Each run is a JSON summary written by `k2c_capstone --json FILE --time-ops` (its "ops_ms": one
step with every operation timed alone), or with --reference, an entry of a reference file named
by its path of keys. Horizontal bars, the most expensive operation on top, one bar per run for each
operation; the legend gives each run's total. Operations below 1 % of every run's total are summed
into "the rest". Where a run has "ops_host_ms" (the host's part of each operation, the GPU idle at
its start: for most, the CPU's time to issue its work; all of it for those that hand a result back
to the host), a dark inner bar shows it.

With --in-step the bars are "ops_in_step_ms" instead: each operation's GPU time inside a step that
ran as usual, and "(between operations)" the time the GPU waited for the host in that step (shown
whatever its size), so the totals are the steps' spans:

    python3 tools/plot_ops.py --in-step --reference autograder/reference/h100.json \
        "capstone/moe_plan_on_device/before" "capstone/moe_plan_on_device/after" \
        --png lectures/figures/capstone_moe_plan_on_device.png
"""
import argparse
import json
import sys

import k2c_tools


IDLE = "(between operations)"


def load(args):
    """[(label, {operation: ms}, {operation: host ms} or None)] from the files or the reference entries."""
    field = "ops_in_step_ms" if args.in_step else "ops_ms"

    def times(run):  # in a step the host's part is not measured apart
        return run[field], None if args.in_step else run.get("ops_host_ms")
    runs = []
    if args.reference:
        with open(args.reference) as f:
            ref = json.load(f)
        for path in args.entries:
            node = ref
            for key in path.split("/"):
                node = node[key]
            runs.append((path.split("/")[-1], *times(node)))
    else:
        for path in args.entries:
            with open(path) as f:
                run = json.load(f)
            runs.append((f"{path} ({run.get('grid', '?')})", *times(run)))
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("entries", nargs="+", help="k2c_capstone JSON files, or paths of keys with --reference")
    ap.add_argument("--reference", metavar="JSON", help="read the entries from this reference file")
    ap.add_argument("--labels", nargs="+", help="a name for each run in the legend (default: where it came from)")
    ap.add_argument("--png", default="ops.png", help="output image (default ops.png)")
    ap.add_argument("--in-step", action="store_true",
                    help="plot ops_in_step_ms (times inside a step as it ran, the GPU's idle time beside them)")
    args = ap.parse_args()
    if args.labels and len(args.labels) != len(args.entries):
        ap.error(f"{len(args.labels)} labels for {len(args.entries)} runs")
    try:
        runs = load(args)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"plot_ops.py: no per-operation times there (run k2c_capstone with --time-ops"
              f"{'; ops_in_step_ms needs a build that records it' if args.in_step else ''}): {e}", file=sys.stderr)
        return 1
    if args.labels:
        runs = [(label, ops, host) for label, (_, ops, host) in zip(args.labels, runs)]
    plt = k2c_tools.pyplot("plot_ops.py")
    if plt is None:
        return 1

    totals = [sum(ops.values()) for _, ops, _ in runs]
    names = {op for _, ops, _ in runs for op in ops}
    shown = sorted((op for op in names
                    if op == IDLE or any(ops.get(op, 0) >= 0.01 * t for (_, ops, _), t in zip(runs, totals))),
                   key=lambda op: max(ops.get(op, 0) for _, ops, _ in runs))
    rows = ["the rest"] + shown

    def values(ops):  # per row, "the rest" first: what the shown operations leave of the total
        return [sum(v for op, v in ops.items() if op not in shown) if row == "the rest" else ops.get(row, 0)
                for row in rows]
    if all(values(ops)[0] <= 0 for _, ops, _ in runs):
        rows = shown

    height = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(rows) * max(1, len(runs) / 1.5) + 1.2))
    host_labelled = False
    for i, ((label, ops, host), total) in enumerate(zip(runs, totals)):
        ys = [y + (i - (len(runs) - 1) / 2) * height for y in range(len(rows))]
        ax.barh(ys, values(ops), height, label=f"{label}: {total:.1f} ms")
        if host:
            ax.barh(ys, values(host), height * 0.4, color="black", alpha=0.55,
                    label=None if host_labelled else "the host's part (issuing the work)")
            host_labelled = True
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows)
    ax.set_xlabel("ms in one step as it ran (GPU time between events)" if args.in_step
                  else "ms in one step, each operation timed alone")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Where one training step's time goes")
    fig.tight_layout()
    fig.savefig(args.png, dpi=130)
    print(f"plot_ops.py: wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
