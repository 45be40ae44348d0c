#!/usr/bin/env python3
"""Every grid of N ranks on one figure: one rank's memory, and its traffic a step, side by side.

    build/solutions/bin/k2c_capstone --plan-ranks 8 --config dense-135m --batch 16 --json grids.json
    python3 tools/plot_grids.py grids.json [--memory-gib 131] --png grids.png

The JSON is k2c_capstone's plan (autograder/18_capstone/grid_plan.h). One row per grid, in the
plan's order (the least traffic first). Left, the busiest rank's memory: training state, and on
top the estimated peak of its activations; --memory-gib draws a GPU's memory as a line, and the
grids past it do not fit. Right, the wire bytes it sends in one step, by purpose: tp's
all-reduces, pp's messages and ep's exchanges, which sit on the path of every token, then the
gradients' reductions (hatched where they can hide under compute: DataParallel's under backward,
and most of ZeRO's; solid under ep, which reduces them after backward). A pipeline's row gives its bubble. Each figure is
its grid's busiest stage's.
"""
import argparse
import json
import sys

import k2c_tools


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("plan", help="k2c_capstone --plan-ranks N --json FILE")
    ap.add_argument("--memory-gib", type=float, help="a GPU's memory, drawn as a line")
    ap.add_argument("--png", default="grids.png", help="output image (default grids.png)")
    args = ap.parse_args()
    gib = 2.0**30
    try:
        with open(args.plan) as f:
            plan = json.load(f)
        grids = plan["grids"]
        rows = []
        for g in grids:
            busiest = max(g["stages"], key=lambda s: s["param_bytes"] + s["grad_bytes"] + s["optimizer_bytes"] +
                          s["activation_bytes"])
            state = (busiest["param_bytes"] + busiest["grad_bytes"] + busiest["optimizer_bytes"]) / gib
            name = g["grid"] + (f" zero{g['zero_stage']}" if g["zero_stage"] else "")
            if g["micro_batches"] > 1:
                name += f", m {g['micro_batches']}"
            if g["bubble"] > 0:
                name += f"  (bubble {100 * g['bubble']:.0f} %)"
            # DataParallel's all-reduces run under backward, and most of ZeRO's traffic under its
            # passes; under ep the gradients are reduced after backward.
            hidden = "ep" not in g["grid"]
            rows.append((name, state, busiest["activation_bytes"] / gib,
                         {a: g["wire_bytes"][a] / gib for a in ("gradients", "tp", "pp", "ep")}, hidden))
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"plot_grids.py: not a plan written by k2c_capstone --plan --json: {e}", file=sys.stderr)
        return 1
    if not rows:
        print("plot_grids.py: the plan lists no grid", file=sys.stderr)
        return 1
    plt = k2c_tools.pyplot("plot_grids.py")
    if plt is None:
        return 1

    rows.reverse()  # the first grid on top
    ys = range(len(rows))
    fig, (mem, net) = plt.subplots(1, 2, sharey=True, figsize=(11, 0.35 * len(rows) + 1.6))
    mem.barh(ys, [r[1] for r in rows], color="tab:blue", label="training state")
    mem.barh(ys, [r[2] for r in rows], left=[r[1] for r in rows], color="tab:cyan", label="activations (estimated)")
    most = max(r[1] + r[2] for r in rows)
    if args.memory_gib and args.memory_gib <= 1.5 * most:
        mem.axvline(args.memory_gib, color="tab:red", ls="--", lw=1, label=f"{args.memory_gib:g} GiB")
    elif args.memory_gib:  # far off the scale: said, not drawn
        mem.plot([], [], " ", label=f"every grid under {args.memory_gib:g} GiB")
    mem.set_yticks(list(ys))
    mem.set_yticklabels([r[0] for r in rows], fontsize=8)
    mem.set_xlabel("GiB on the busiest rank")
    mem.legend(fontsize=8, loc="best")
    left = [0.0] * len(rows)
    for axis, color, what in (("tp", "tab:orange", "tp"), ("pp", "tab:green", "pp"),
                              ("ep", "tab:purple", "ep, routing even")):
        widths = [r[3][axis] for r in rows]
        net.barh(ys, widths, left=left, color=color, label=f"{what} (on every token's path)")
        left = [a + b for a, b in zip(left, widths)]
    for hidden, style in ((True, dict(color="tab:gray", hatch="//", alpha=0.6, label="gradients, under compute")),
                          (False, dict(color="dimgray", label="gradients, after backward (ep)"))):
        widths = [r[3]["gradients"] if r[4] == hidden else 0 for r in rows]
        if any(widths):
            net.barh(ys, widths, left=left, **style)
    net.set_xlabel("GiB a step on the busiest rank's links")
    net.legend(fontsize=8, loc="best")
    for ax in (mem, net):
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(f"Grids of {grids[0]['ranks']} ranks, {plan.get('model', '')}, batch {plan.get('batch', '?')} x "
                 f"{plan.get('seq_len', '?')}, {plan.get('activations', '?')} activations", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.png, dpi=130)
    print(f"plot_grids.py: wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
