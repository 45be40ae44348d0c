#!/usr/bin/env python3
"""Draw the SGEMM ladder from the benchmark JSON of modules 01-04, and refresh the README table.

    tools/plot_ladder.py BENCH_DIR [--png lectures/figures/sgemm_ladder.png] [--readme README.md]

BENCH_DIR holds Google Benchmark JSON written by `k2c bench` (one file per module). Every
BM_<module>_sgemm/<variant>/<n> entry becomes a point; each variant is a line of TFLOP/s by
size, cuBLAS (version 0) included. The README's table between <!-- ladder:begin --> and
<!-- ladder:end --> is rewritten with the same numbers. matplotlib is needed for the PNG only.
"""
import argparse
import json
import pathlib
import re

ORDER = [("cublas", "0 cuBLAS"), ("naive", "1 naive"), ("coalesced", "2 coalesced"),
         ("tile32", "3a tile 32x32"), ("tiled", "3 tiled"), ("register_tiled", "4 register-tiled")]

ap = argparse.ArgumentParser()
ap.add_argument("bench_dir")
ap.add_argument("--png", default="lectures/figures/sgemm_ladder.png")
ap.add_argument("--readme", default="README.md")
args = ap.parse_args()

rates, gpu = {}, "GPU"
for path in sorted(pathlib.Path(args.bench_dir).glob("*.json")):
    data = json.loads(path.read_text())
    gpu = data.get("context", {}).get("gpu", gpu)
    for b in data.get("benchmarks", []):
        m = re.match(r"BM_\w+_sgemm/(\w+)/(\d+)", b["name"])
        if m and "TFLOP/s" in b:
            rates.setdefault(m.group(1), {})[int(m.group(2))] = b["TFLOP/s"]
variants = [(v, label) for v, label in ORDER if v in rates]
if not variants:
    raise SystemExit(f"no BM_*_sgemm results in {args.bench_dir}")
sizes = sorted({n for v, _ in variants for n in rates[v]})

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for v, label in variants:
        xs = sorted(rates[v])
        ax.plot(xs, [rates[v][n] for n in xs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # the rungs span two orders of magnitude
    ticks = [n for n in sizes if n & (n - 1) == 0]  # label the powers of two only
    ax.set_xticks(ticks, [str(n) for n in ticks])
    ax.minorticks_off()
    ax.set_xlabel("M = N = K")
    ax.set_ylabel("TFLOP/s (fp32)")
    ax.set_title(f"SGEMM ladder on {gpu}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    pathlib.Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=120)
    print(f"wrote {args.png}")
except ImportError:
    print("matplotlib not found: no plot (the table is still written)")

cublas = rates.get("cublas", {})
head = "| n | " + " | ".join(label for _, label in variants) + " | 4 / cuBLAS |"
rows = [f"SGEMM ladder on {gpu}, TFLOP/s (Google Benchmark: CUDA-event time of each run after an L2 flush, mean of 3 to 10 runs):",
        "", head, "|" + "---|" * (len(variants) + 2)]
for n in sizes:
    cells = [f"{rates[v][n]:.2f}" if n in rates[v] else "" for v, _ in variants]
    reg = rates.get("register_tiled", {}).get(n)
    pct = f"{100 * reg / cublas[n]:.0f}%" if reg and n in cublas else ""
    rows.append(f"| {n} | " + " | ".join(cells) + f" | {pct} |")

readme = pathlib.Path(args.readme)
text = readme.read_text()
new, count = re.subn(r"(<!-- ladder:begin -->\n).*?(<!-- ladder:end -->)",
                     lambda m: m.group(1) + "\n".join(rows) + "\n" + m.group(2), text, flags=re.S)
if count == 1:
    readme.write_text(new)
    print(f"{readme}: ladder table updated")
else:
    print(f"{readme}: no ladder markers, table not written")
