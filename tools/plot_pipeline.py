#!/usr/bin/env python3
"""plot_pipeline.py TRACE.json [-o timeline.svg] [--png timeline.png]

The timeline of a pipeline's schedule from k2c_pipeline_parallel's trace (module 15): one panel
per run (schedule, with or without recomputation), one row per stage, a box per forward (light)
and backward (dark) pass labelled with its micro-batch, time running left to right. The gaps in
the rows are the bubble. Each panel's title gives the step time, the idle fraction the trace
shows and the (p - 1)/(m + p - 1) that equal stages would leave.

The SVG needs nothing but Python; --png draws the same with matplotlib where it is installed.
"""
import argparse
import json
import sys
from xml.sax.saxutils import escape

FORWARD, BACKWARD = "#9ecae1", "#3182bd"
ROW, GAP, LEFT, TOP, WIDTH = 26, 4, 70, 34, 900


def title(run, doc):
    rc = ", recompute" if run["recompute"] else ""
    return (f"{run['schedule']}{rc}: step {run['step_ms']:.2f} ms, idle {run['idle']:.3f} "
            f"(bubble (p-1)/(m+p-1) = {doc['bubble']:.3f}), peak activations "
            + " / ".join(f"{v:.1f}" for v in run["peak_activation_mib"]) + " MiB")


def span(run):
    ev = run["events"]
    if not ev:
        return 0.0, 1.0
    t0 = min(e["start_ms"] for e in ev)
    t1 = max(e["end_ms"] for e in ev)
    return t0, max(t1, t0 + 1e-9)


def svg(doc):
    p = doc["stages"]
    panel = TOP + p * (ROW + GAP) + 26
    height = panel * len(doc["runs"]) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + 20}" height="{height}" '
           'font-family="sans-serif" font-size="11">',
           f'<text x="8" y="18" font-size="13">{escape(doc["model"])}; {p} stages, '
           f'{doc["micro_batches"]} micro-batches, {escape(doc["backend"])}</text>']
    for i, run in enumerate(doc["runs"]):
        y0 = 30 + i * panel
        t0, t1 = span(run)
        scale = WIDTH / (t1 - t0)
        out.append(f'<text x="8" y="{y0 + 16}">{escape(title(run, doc))}</text>')
        for s in range(p):
            y = y0 + TOP + s * (ROW + GAP) - 10
            out.append(f'<text x="8" y="{y + ROW * 0.65:.1f}">stage {s}</text>')
            out.append(f'<rect x="{LEFT}" y="{y}" width="{WIDTH}" height="{ROW}" fill="#f4f4f4"/>')
        for e in run["events"]:
            x = LEFT + (e["start_ms"] - t0) * scale
            w = max((e["end_ms"] - e["start_ms"]) * scale, 0.5)
            y = y0 + TOP + int(e["stage"]) * (ROW + GAP) - 10
            colour = FORWARD if e["pass"] == "F" else BACKWARD
            out.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{ROW}" fill="{colour}" '
                       f'stroke="white" stroke-width="0.5"><title>{e["pass"]}{int(e["micro_batch"])}: '
                       f'{e["start_ms"]:.3f} to {e["end_ms"]:.3f} ms</title></rect>')
            if w > 14:
                ink = "black" if e["pass"] == "F" else "white"
                out.append(f'<text x="{x + w / 2:.2f}" y="{y + ROW * 0.65:.1f}" text-anchor="middle" '
                           f'fill="{ink}">{e["pass"]}{int(e["micro_batch"])}</text>')
        yb = y0 + TOP + p * (ROW + GAP)
        out.append(f'<text x="{LEFT}" y="{yb}">0 ms</text>')
        out.append(f'<text x="{LEFT + WIDTH}" y="{yb}" text-anchor="end">{t1 - t0:.2f} ms</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def png(doc, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("--png needs matplotlib (Debian: python3-matplotlib); the SVG needs nothing")
    p, runs = doc["stages"], doc["runs"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.2 + 0.45 * p * len(runs) + 0.5 * len(runs)),
                             squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        t0, t1 = span(run)
        for e in run["events"]:
            colour = FORWARD if e["pass"] == "F" else BACKWARD
            ax.barh(int(e["stage"]), e["end_ms"] - e["start_ms"], left=e["start_ms"] - t0, height=0.8,
                    color=colour, edgecolor="white", linewidth=0.5)
            if (e["end_ms"] - e["start_ms"]) / (t1 - t0) > 0.02:
                ax.text((e["start_ms"] + e["end_ms"]) / 2 - t0, int(e["stage"]), f'{e["pass"]}{int(e["micro_batch"])}',
                        ha="center", va="center", fontsize=7, color="black" if e["pass"] == "F" else "white")
        ax.set_yticks(range(p))
        ax.set_yticklabels([f"stage {s}" for s in range(p)])
        ax.set_ylim(p - 0.5, -0.5)
        ax.set_xlim(0, t1 - t0)
        ax.set_title(title(run, doc), fontsize=8, loc="left")
    axes[-1, 0].set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=150)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("-o", "--svg", default="pipeline_timeline.svg")
    ap.add_argument("--png", help="also draw a PNG (needs matplotlib)")
    args = ap.parse_args()
    with open(args.trace) as f:
        doc = json.load(f)
    with open(args.svg, "w") as f:
        f.write(svg(doc))
    print(f"wrote {args.svg}")
    if args.png:
        png(doc, args.png)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
