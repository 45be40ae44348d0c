#!/usr/bin/env python3
"""Draw module 10's benchmark sweep: the grouped GEMM's versions beside cuBLAS called once per
expert (and PyTorch's, where measured), and the whole layer's forward + backward time beside the
naive layers.

    tools/plot_moe.py BENCH_DIR [--png lectures/figures/moe.png] [--torch torch_moe.json]

BENCH_DIR holds Google Benchmark JSON written by `k2c bench` (entries BM_moe/...). --torch adds
what tools/compare_torch_moe.py measured, when that file exists. The numbers are printed as a
table too, so the script is useful without matplotlib.
"""
import json
import pathlib

import k2c_tools

args = k2c_tools.plot_args("lectures/figures/moe.png", torch="tools/compare_torch_moe.py")

# gemm[(proj, loads)][variant] = TFLOP/s; layer[name] = ms
gemm, layer = {}, {}
gpu, entries = k2c_tools.benchmarks(args.bench_dir)
for m, rate in k2c_tools.matches(entries, r"BM_moe/(grouped|hopper|cublas_loop)/(up|down)/(uniform|skewed)", "TFLOP/s"):
    gemm.setdefault((m.group(2), m.group(3)), {})[m.group(1)] = rate
for m, ms in k2c_tools.matches(entries, r"BM_moe/(layer|naive)/(forward_backward|forward)", "real_time"):
    layer[f"{m.group(1)} {m.group(2)}"] = ms
if not gemm and not layer:
    raise SystemExit(f"no BM_moe results in {args.bench_dir}")
torch = json.loads(pathlib.Path(args.torch).read_text()) if args.torch and pathlib.Path(args.torch).exists() else {}

labels = {"grouped": "grouped_gemm (mma.sync)", "hopper": "grouped_gemm_hopper (wgmma)",
          "cublas_loop": "cuBLAS once per expert"}
print(f"module 10 on {gpu}: grouped GEMM, TFLOP/s")
for key in sorted(gemm):
    print(f"  {key[0]:>4} {key[1]:>8}: " + ", ".join(f"{labels[v]} {t:.1f}" for v, t in sorted(gemm[key].items())))
for name in ("loop", "grouped_mm"):
    if "TFLOP/s" in torch.get(name, {}):
        print(f"  PyTorch {name} (up, uniform): {torch[name]['TFLOP/s']:.1f}")
print("layer, ms: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(layer.items())))
if "ms" in torch.get("naive_layer", {}):
    print(f"  PyTorch naive layer forward_backward {torch['naive_layer']['ms']:.2f}")

plt = k2c_tools.pyplot("plot_moe.py (the table above is all)")
if plt is None:
    raise SystemExit(1)

fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [3, 2]})
keys = [k for k in (("up", "uniform"), ("up", "skewed"), ("down", "uniform"), ("down", "skewed")) if k in gemm]
variants = ["cublas_loop", "grouped", "hopper"]
colors = {"cublas_loop": "#888888", "grouped": "#4c72b0", "hopper": "#dd8452"}
width = 0.26
for i, v in enumerate(variants):
    xs = [j + (i - 1) * width for j in range(len(keys))]
    ys = [gemm[k].get(v, 0) for k in keys]
    left.bar(xs, ys, width, label=labels[v], color=colors[v])
    for x, y in zip(xs, ys):
        if y:
            left.text(x, y + 8, f"{y:.0f}", ha="center", fontsize=7)
for name, style in (("grouped_mm", "--"), ("loop", ":")):
    if "TFLOP/s" in torch.get(name, {}):
        left.axhline(torch[name]["TFLOP/s"], color="#55a868", linestyle=style,
                     label=f"PyTorch {'torch._grouped_mm' if name == 'grouped_mm' else 'per-expert loop'} (up, uniform)")
left.set_xticks(range(len(keys)))
left.set_xticklabels([f"{p} projection\n{l} loads" for p, l in keys])
left.set_ylabel("TFLOP/s")
left.set_title("Grouped GEMM, 64 experts, 98,304 rows")
left.set_ylim(0, 1.3 * max(max(v.values()) for v in gemm.values()))
left.legend(fontsize=7, loc="upper center", ncol=2)

names, times = [], []
for k, lab in (("layer forward_backward", "this layer"), ("naive forward_backward", "naive layer\n(k2c/reference/moe_baseline.h)")):
    if k in layer:
        names.append(lab)
        times.append(layer[k])
if "ms" in torch.get("naive_layer", {}):
    names.append("naive PyTorch\nlayer")
    times.append(torch["naive_layer"]["ms"])
right.barh(names, times, color=["#dd8452", "#888888", "#55a868"][: len(names)])
for y, t in enumerate(times):
    right.text(t + 1, y, f"{t:.1f} ms", va="center", fontsize=8)
right.set_xlabel("forward + backward, ms")
right.set_title("The whole layer (T 16384, d 2048, top-6 of 64)")
right.invert_yaxis()
right.set_xlim(0, max(times) * 1.25 if times else 1)
fig.suptitle(f"Module 10 on {gpu}")
fig.tight_layout()
pathlib.Path(args.png).parent.mkdir(parents=True, exist_ok=True)
fig.savefig(args.png, dpi=120)
print(f"wrote {args.png}")
