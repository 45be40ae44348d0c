#!/usr/bin/env python3
"""Draw module 09's benchmark sweep: TFLOP/s against sequence length for the forward pass, the
backward pass, the naive (materialising) forward and Part B's wgmma forward and backward, one
panel per head_dim and mask.

    tools/plot_attention.py BENCH_DIR [--png lectures/figures/attention.png] [--torch torch_attention.json]
    tools/plot_attention.py autograder/reference/h200.json [--png lectures/figures/attention.png]

BENCH_DIR holds Google Benchmark JSON written by `k2c bench` (entries
BM_attention/<pass>/d<head_dim>/<causal|full>/<N>). --torch adds the curves that
tools/compare_torch.py measured (PyTorch's SDPA backends), when that file exists. Given a
reference file instead, the script draws what it records under "attention" (the sweep under
"bench", PyTorch's backends under "torch"), so the lecture's figure is redrawn from the numbers
the lecture quotes. The numbers are printed as a table too, so the script is useful without
matplotlib.
"""
import json
import pathlib
import re

import k2c_tools

args = k2c_tools.plot_args("lectures/figures/attention.png", torch="tools/compare_torch.py")

# ours[(d, mask)][pass][n] = TFLOP/s; theirs likewise for PyTorch's backends ("torch flash forward").
ours, theirs = {}, {}
source = pathlib.Path(args.bench_dir)
if source.is_file():  # a reference file: its "attention" section
    try:
        ref = json.loads(source.read_text())
        section = ref["attention"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise SystemExit(f"plot_attention: {source} is not a reference file with an 'attention' section ({e})")
    gpu = ref.get("gpu", "GPU")
    for panel, passes in section.get("bench", {}).items():
        d, mask = re.fullmatch(r"d(\d+)_(causal|full)", panel).groups()
        ours[(int(d), mask)] = {p: {int(n): r for n, r in by_n.items()} for p, by_n in passes.items()}
    for shape, backends in section.get("torch", {}).items():
        m = re.fullmatch(r"B(\d+)_H\d+_N(\d+)_d(\d+)_(causal|full)", shape)
        if not m or int(m.group(1)) * int(m.group(2)) != 16384:
            continue
        for backend, rates in backends.items():
            for p, rate in rates.items():
                key = (int(m.group(3)), m.group(4))
                theirs.setdefault(key, {}).setdefault(f"torch {backend} {p}", {})[int(m.group(2))] = rate
else:
    gpu, entries = k2c_tools.benchmarks(args.bench_dir)
    for m, rate in k2c_tools.matches(entries, r"BM_attention/(\w+)/d(\d+)/(causal|full)/(\d+)", "TFLOP/s"):
        ours.setdefault((int(m.group(2)), m.group(3)), {}).setdefault(m.group(1), {})[int(m.group(4))] = rate
if not ours:
    raise SystemExit(f"no BM_attention results in {args.bench_dir}")

# PyTorch's FlashAttention 2 and cuDNN backends (the table also lists the others measured).
if args.torch and pathlib.Path(args.torch).exists():
    for r in json.loads(pathlib.Path(args.torch).read_text())["results"]:
        if "error" in r or r["batch"] * r["n"] != 16384:
            continue
        key = (r["d"], "causal" if r["causal"] else "full")
        for p in ("forward", "backward"):
            theirs.setdefault(key, {}).setdefault(f"torch {r['backend']} {p}", {})[r["n"]] = r[f"{p}_tflops"]
PLOTTED = {"torch flash forward", "torch flash backward", "torch cudnn forward", "torch cudnn backward"}

for key in sorted(ours):
    sizes = sorted({n for v in ours[key].values() for n in v})
    print(f"\nd = {key[0]}, {key[1]} (TFLOP/s; 16384 tokens, 2048 channels)")
    print(f"{'pass':28s}" + "".join(f"{n:>9d}" for n in sizes))
    for name, by_n in list(ours[key].items()) + list(theirs.get(key, {}).items()):
        print(f"{name:28s}" + "".join(f"{by_n[n]:>9.1f}" if n in by_n else f"{'-':>9s}" for n in sizes))

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    raise SystemExit("matplotlib not installed: table only")

# Ours solid, PyTorch's dashed (FlashAttention 2) and dotted (cuDNN), one colour per pass.
keys = sorted(ours)
cols = 2 if len(keys) > 2 else len(keys)
rows = (len(keys) + cols - 1) // cols
fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 4.0 * rows), squeeze=False, sharey=True)
colour = {"forward": "tab:blue", "backward": "tab:orange", "naive": "tab:green", "hopper": "tab:red",
          "hopper_backward": "tab:purple"}
label = {"forward": "forward (mma.sync)", "backward": "backward (mma.sync)", "naive": "naive forward (S, P in memory)",
         "hopper": "forward, Part B (wgmma)", "hopper_backward": "backward, Part B (wgmma)"}
for ax, key in zip(axes.flat, keys):
    for name, by_n in ours[key].items():
        ns = sorted(by_n)
        ax.plot(ns, [by_n[n] for n in ns], "o-", color=colour.get(name), label=label.get(name, name))
    for name, by_n in theirs.get(key, {}).items():
        if name not in PLOTTED:
            continue
        ns = sorted(by_n)
        ax.plot(ns, [by_n[n] for n in ns], "--" if "flash" in name else ":",
                color=colour["forward" if name.endswith("forward") else "backward"], alpha=0.8,
                label=name.replace("torch flash", "PyTorch FA2").replace("torch cudnn", "PyTorch cuDNN"))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length N")
    ax.set_title(f"d = {key[0]}, {key[1]}")
    ax.grid(True, alpha=0.3)
for ax in axes[:, 0]:
    ax.set_ylabel("TFLOP/s")
for ax in axes.flat[len(keys):]:
    ax.axis("off")
axes.flat[cols - 1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
fig.suptitle(f"09 FlashAttention on {gpu}: bf16, 16384 tokens x 2048 channels per call")
fig.tight_layout()
pathlib.Path(args.png).parent.mkdir(parents=True, exist_ok=True)
fig.savefig(args.png, dpi=110)
print(f"\nwrote {args.png}")
