#!/usr/bin/env python3
"""Draw the GEMM ladders from the benchmark JSON of modules 01-05.

    tools/plot_ladder.py BENCH_DIR [--png lectures/figures/sgemm_ladder.png]

BENCH_DIR holds Google Benchmark JSON written by `k2c bench` (one file per module). Every
BM_<module>_sgemm/<variant>/<n> entry (fp32, modules 01-04) and BM_<module>_bf16gemm/<variant>/<n>
entry (bf16 tensor cores, module 05) becomes a point; each variant is a line of TFLOP/s by size,
cuBLAS (version 0 of each ladder) included. The figure has one panel per ladder, and the same
numbers are printed as a table. The README's ladder tables come from the reference file instead
(`autograder/reference/h200.json`, under `gemm_ladder`), written by tools/figures.py.
matplotlib is needed for the PNG only.
"""
import pathlib

import k2c_tools

LADDERS = {
    "sgemm": ("SGEMM ladder", "TFLOP/s (fp32)", "ladder",
              [("cublas", "0 cuBLAS"), ("naive", "1 naive"), ("coalesced", "2 coalesced"),
               ("tile32", "3a tile 32x32"), ("tiled", "3 tiled"), ("register_tiled", "4 register-tiled")],
              "register_tiled", "4 / cuBLAS"),
    "bf16gemm": ("bf16 tensor-core ladder", "TFLOP/s (bf16 in, fp32 accumulate)", "bf16",
                 [("cublas", "0 cuBLAS bf16"), ("mma_sync", "5A mma.sync"), ("wgmma", "5B wgmma")],
                 None, None),
}

args = k2c_tools.plot_args("lectures/figures/sgemm_ladder.png")

rates = {}  # rates[ladder][variant][n]
gpu, entries = k2c_tools.benchmarks(args.bench_dir)
for m, rate in k2c_tools.matches(entries, r"BM_\w+?_(sgemm|bf16gemm)/(\w+)/(\d+)", "TFLOP/s"):
    rates.setdefault(m.group(1), {}).setdefault(m.group(2), {})[int(m.group(3))] = rate
ladders = [k for k in LADDERS if k in rates]
if not ladders:
    raise SystemExit(f"no BM_*_sgemm or BM_*_bf16gemm results in {args.bench_dir}")


def variants_of(ladder):
    return [(v, label) for v, label in LADDERS[ladder][3] if v in rates[ladder]]


try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(ladders), figsize=(8 * len(ladders), 5), squeeze=False)
    for ax, ladder in zip(axes[0], ladders):
        title, ylabel = LADDERS[ladder][0], LADDERS[ladder][1]
        sizes = sorted({n for v, _ in variants_of(ladder) for n in rates[ladder][v]})
        for v, label in variants_of(ladder):
            xs = sorted(rates[ladder][v])
            ax.plot(xs, [rates[ladder][v][n] for n in xs], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # the rungs span orders of magnitude
        ticks = [n for n in sizes if n & (n - 1) == 0]  # label the powers of two only
        ax.set_xticks(ticks, [str(n) for n in ticks])
        ax.minorticks_off()
        ax.set_xlabel("M = N = K")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title} on {gpu}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    pathlib.Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=120)
    print(f"wrote {args.png}")
except ImportError:
    print("matplotlib not found: no plot (the table is still printed)")

for ladder in ladders:
    title, _, _, _, best, best_label = LADDERS[ladder]
    variants = variants_of(ladder)
    sizes = sorted({n for v, _ in variants for n in rates[ladder][v]})
    cublas = rates[ladder].get("cublas", {})
    ratio_cols = [(v, f"{label.split()[0]} / cuBLAS") for v, label in variants if v != "cublas"]
    if best:
        ratio_cols = [(best, best_label)]
    print(f"{title} on {gpu}, TFLOP/s")
    print("| n | " + " | ".join(label for _, label in variants) + " | " +
          " | ".join(label for _, label in ratio_cols) + " |")
    for n in sizes:
        cells = [f"{rates[ladder][v][n]:.2f}" if n in rates[ladder][v] else "" for v, _ in variants]
        for v, _ in ratio_cols:
            r = rates[ladder].get(v, {}).get(n)
            cells.append(f"{100 * r / cublas[n]:.0f}%" if r and n in cublas else "")
        print(f"| {n} | " + " | ".join(cells) + " |")
