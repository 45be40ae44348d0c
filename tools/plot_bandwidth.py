#!/usr/bin/env python3
"""Draw the memory-bound modules' benchmark results (06 softmax, 07 RMSNorm, 08 RoPE) as GB/s
beside the copy ceiling measured in the same run.

    tools/plot_bandwidth.py BENCH_DIR [--png lectures/figures/bandwidth.png]

BENCH_DIR holds Google Benchmark JSON written by `k2c bench`. Every BM_<module>/<variant>/<size>
entry is a point: one panel per module, one group of bars per size (row length for softmax and
RMSNorm, head_dim for RoPE), one bar per variant; the variant "copy" (cudaMemcpy of the bytes the
kernel must move) is drawn as a line over its group, the ceiling each bar is judged against.
The numbers are printed as a table too, so the script is useful without matplotlib.
"""
import pathlib

import k2c_tools

MODULES = [("softmax", "06 softmax, bf16, 64 Mi elements", "row length"),
           ("rmsnorm", "07 RMSNorm, bf16, 64 Mi elements", "row length"),
           ("rope", "08 RoPE, 4 x 4096 tokens, heads 32/8", "head_dim")]

args = k2c_tools.plot_args("lectures/figures/bandwidth.png")

# results[module][variant][size] = GB/s
results = {}
gpu, entries = k2c_tools.benchmarks(args.bench_dir)
for m, rate in k2c_tools.matches(entries, r"BM_(softmax|rmsnorm|rope)/(\w+)/(\d+)", "GB/s"):
    results.setdefault(m.group(1), {}).setdefault(m.group(2), {})[int(m.group(3))] = rate
if not results:
    raise SystemExit(f"no BM_softmax, BM_rmsnorm or BM_rope results in {args.bench_dir}")

for module, title, _ in MODULES:
    if module not in results:
        continue
    variants = results[module]
    sizes = sorted({n for v in variants.values() for n in v})
    print(f"\n{title} (GB/s; ratio to the copy of the same bytes)")
    print(f"{'variant':24s}" + "".join(f"{n:>16d}" for n in sizes))
    for v, by_size in variants.items():
        cells = []
        for n in sizes:
            if n not in by_size:
                cells.append(f"{'-':>16s}")
                continue
            copy = variants.get("copy", {}).get(n)
            ratio = f" ({by_size[n] / copy:.2f})" if copy and v != "copy" else ""
            cells.append(f"{by_size[n]:>9.0f}{ratio:>7s}")
        print(f"{v:24s}" + "".join(cells))

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    raise SystemExit("matplotlib not installed: table only")

present = [m for m in MODULES if m[0] in results]
fig, axes = plt.subplots(len(present), 1, figsize=(11, 3.6 * len(present)), squeeze=False)
for ax, (module, title, xlabel) in zip(axes[:, 0], present):
    variants = results[module]
    names = [v for v in variants if v != "copy"]
    sizes = sorted({n for v in variants.values() for n in v})
    width = 0.8 / max(1, len(names))
    for i, v in enumerate(names):
        xs = [k + (i - (len(names) - 1) / 2) * width for k in range(len(sizes))]
        ax.bar(xs, [variants[v].get(n, 0) for n in sizes], width, label=v)
    copy = variants.get("copy", {})
    for k, n in enumerate(sizes):
        if n in copy:
            ax.hlines(copy[n], k - 0.45, k + 0.45, colors="black", linewidth=2,
                      label="cudaMemcpy, same bytes" if k == 0 else None)
    ax.set_xticks(range(len(sizes)), [str(n) for n in sizes])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("GB/s (read + written)")
    ax.set_title(f"{title} on {gpu}")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars
fig.tight_layout()
pathlib.Path(args.png).parent.mkdir(parents=True, exist_ok=True)
fig.savefig(args.png, dpi=110)
print(f"\nwrote {args.png}")
