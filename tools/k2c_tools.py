"""Helpers that several tools share: reading the Google Benchmark JSON that `k2c bench` writes
(tools/plot_*.py) and timing PyTorch with CUDA events (tools/compare_torch*.py).

Not a program: the tools import it from their own folder (`import k2c_tools`), which Python puts
first on the path when it runs `tools/plot_moe.py` and the like.

    pyplot(tool)                           -> matplotlib.pyplot on the Agg backend, or None (said why)
    plot_args(png, torch=None)             -> the plot tools' command line, parsed
    benchmarks(bench_dir)                  -> (gpu, [benchmark entry, ...]) of every *.json there
    matches(entries, pattern, field)       -> (regex match, value) of the entries named by pattern
    need_torch(what)                       -> the torch module, or exit saying why nothing was measured
    median_ms(torch, fn, repeats, warmup)  -> the median time of fn() in milliseconds, CUDA events
"""
import argparse
import json
import pathlib
import re
import statistics
import sys


def pyplot(tool):
    """matplotlib.pyplot drawing to files (the Agg backend), or None after telling stderr that
    `tool` needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{tool}: matplotlib is not installed (pip install matplotlib; Debian: python3-matplotlib)",
              file=sys.stderr)
        return None
    return plt


def plot_args(png, torch=None):
    """Parses BENCH_DIR [--png PATH], and --torch FILE where the tool can add what a
    tools/compare_torch*.py run measured (torch: that tool's name, for the help text)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("bench_dir", help="the Google Benchmark JSON that `k2c bench` wrote")
    ap.add_argument("--png", default=png)
    if torch:
        ap.add_argument("--torch", default=None, help=f"what {torch} measured, when that file exists")
    return ap.parse_args()


def benchmarks(bench_dir):
    """The GPU's name (from the files' context, "GPU" if none says) and every benchmark entry of
    the JSON files in bench_dir, in file-name order. A file that is not JSON is passed over: a
    program that ran no benchmark leaves an empty one."""
    gpu, entries = "GPU", []
    for path in sorted(pathlib.Path(bench_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, OSError):
            continue
        gpu = data.get("context", {}).get("gpu", gpu)
        entries += data.get("benchmarks", [])
    return gpu, entries


def need_torch(what="PyTorch"):
    """Imports torch and checks that it sees a CUDA device; otherwise exits with the reason.
    PyTorch is not a dependency of the course, so a comparison with it is optional."""
    try:
        import torch
    except ImportError as e:
        sys.exit(f"{what} is needed for this comparison ({e}); nothing measured")
    if not torch.cuda.is_available():
        sys.exit("no CUDA device visible to PyTorch; nothing measured")
    return torch


def median_ms(torch, fn, repeats, warmup, before=None):
    """Runs fn() warmup times, then repeats times between two CUDA events, and returns the median
    in milliseconds. before(), when given, runs ahead of each timed call, outside the events (an
    L2 flush, say)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if before:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def matches(entries, pattern, field):
    """(match, entry[field]) for every entry whose name matches the regex pattern from its start
    and that carries field (a counter such as "TFLOP/s", or "real_time")."""
    for b in entries:
        m = re.match(pattern, b["name"])
        if m and field in b:
            yield m, b[field]
