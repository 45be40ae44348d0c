#!/usr/bin/env python3
"""Merge one graded run's reference timings into the course's reference file, module by module.

    k2c grade --impl solutions --modules 05,19 --write-reference run.json
    python3 tools/merge_reference.py run.json [--into autograder/reference/h200.json]

A run that grades some modules, or one whose multi-GPU tests were skipped, writes figures for
what it measured only: each module it measured replaces that module's entry whole (a module's
figures always come from one run), with the run's date and seed beside it (`module_dates`,
`module_seeds`), and the ceilings it measured replace those of the same name. Modules it did not
measure, and the benchmark sections of the file, stay as they were. Both files must name the same
GPU; afterwards `make figures` rewrites the docs from the merged file.

    python3 tools/merge_reference.py --capstone "dense-135m course bf16=run.json" [NAME=FILE ...]

puts `k2c_capstone --json FILE` summaries (a run with --time-ops; tools/capstone-runs.sh makes the
standard set) into the file's `capstone` section under those names, each replacing the entry of
its name whole, with the day of the merge as its `date`. The section's `$comment` says which
session each entry comes from: edit it to match.
"""
import argparse
import datetime
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


# What a capstone entry keeps of a run's summary: the run itself, its rate, and where its time went
# (`kernels`, `activations`, `residual`, `ops_host_ms`, `ops_in_step_ms`, `bucket_bytes` and
# `--traffic`'s last step beside its plan where the run has them).
CAPSTONE_KEYS = ("grid", "ranks", "model", "median_tokens_per_s", "model_tflops_per_rank", "cublas_bf16_tflops",
                 "ratio", "peak_memory_bytes_rank0", "kernels", "ops_ms", "ops_host_ms", "ops_in_step_ms", "activations",
                 "residual", "bucket_bytes", "traffic_sent", "traffic_planned")
CAPSTONE_REQUIRED = ("grid", "model", "median_tokens_per_s", "ratio", "ops_ms")


def load(path, what):
    """The JSON object in `path`, or the end of the run with a message naming the file and `what` it should be."""
    try:
        data = json.loads(pathlib.Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        sys.exit(f"merge_reference: {path} ({what}): {e}")
    if not isinstance(data, dict):
        sys.exit(f"merge_reference: {path} ({what}): a JSON object expected, found {type(data).__name__}")
    return data


def is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def expect_objects(path, data, *keys):
    """Each of `keys` that `data` has must be a JSON object."""
    for key in keys:
        if key in data and not isinstance(data[key], dict):
            sys.exit(f"merge_reference: {path}: '{key}' must be an object, found {type(data[key]).__name__}")


def write(path, ref):
    """The whole file at once: a partly written reference file is never left behind."""
    part = pathlib.Path(str(path) + ".part")
    part.write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n")
    part.replace(path)


def merge_capstone(pairs, into):
    ref = load(into, "the reference file")
    expect_objects(into, ref, "capstone")
    entries = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path or name.startswith("$"):
            sys.exit(f"merge_reference: --capstone takes NAME=FILE, got {pair!r}")
        run = load(path, "a k2c_capstone summary")
        missing = [k for k in CAPSTONE_REQUIRED if k not in run]
        if missing:
            sys.exit(f"merge_reference: {path} has no {', '.join(missing)}: not a `k2c_capstone --json --time-ops` summary "
                     "of a GPU run")
        bad = [k for k in ("median_tokens_per_s", "ratio") if not is_number(run[k])]
        if bad:
            sys.exit(f"merge_reference: {path}: {', '.join(bad)} must be numbers")
        expect_objects(path, run, "ops_ms", "ops_host_ms", "ops_in_step_ms", "kernels")
        entries[name] = {k: run[k] for k in CAPSTONE_KEYS if k in run}
        entries[name]["date"] = datetime.date.today().isoformat()
    ref.setdefault("capstone", {}).update(entries)
    write(into, ref)
    for name, e in entries.items():
        print(f"merge_reference: capstone '{name}': {e['median_tokens_per_s']:,} tokens/s, {e['ratio']:.3f} of cuBLAS")
    print("merge_reference: check the capstone section's $comment names these runs' session")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?", help="the file `k2c grade --write-reference` wrote")
    ap.add_argument("--into", default=str(ROOT / "autograder/reference/h200.json"))
    ap.add_argument("--capstone", nargs="+", metavar="NAME=FILE", help="k2c_capstone summaries into the capstone section")
    a = ap.parse_args()
    if a.capstone:
        if a.run:
            sys.exit("merge_reference: give a graded run or --capstone, not both")
        return merge_capstone(a.capstone, a.into)
    if not a.run:
        ap.error("give the file `k2c grade --write-reference` wrote, or --capstone NAME=FILE")
    run = load(a.run, "a graded run's reference timings")
    ref = load(a.into, "the reference file")
    for key in ("gpu", "date", "seed", "modules"):
        if key not in run:
            sys.exit(f"merge_reference: {a.run} has no '{key}': not a file `k2c grade --write-reference` wrote")
    expect_objects(a.run, run, "modules", "ceilings")
    expect_objects(a.into, ref, "modules", "module_dates", "module_seeds", "ceilings")
    for path, data in ((a.run, run), (a.into, ref)):
        for module, tests in data.get("modules", {}).items():
            if not isinstance(tests, dict) or not all(isinstance(t, dict) for t in tests.values()):
                sys.exit(f"merge_reference: {path}: module {module}'s figures must be an object of objects, one a test")
    if run["gpu"] != ref.get("gpu"):
        sys.exit(f"merge_reference: {a.run} was measured on {run['gpu']!r}, {a.into} holds {ref.get('gpu')!r}")

    measured = {m: tests for m, tests in run["modules"].items() if tests}
    if not measured:
        sys.exit(f"merge_reference: {a.run} holds no module's figures")
    for module, tests in measured.items():
        ref.setdefault("modules", {})[module] = tests
        ref.setdefault("module_dates", {})[module] = run["date"]
        ref.setdefault("module_seeds", {})[module] = run["seed"]
    ref.setdefault("ceilings", {}).update(run.get("ceilings", {}))
    # A ceiling no module's figures name any more (a test renamed its ceiling) goes.
    named = {t.get("ceiling_name") for tests in ref["modules"].values() for t in tests.values()}
    for name in [c for c in ref["ceilings"] if c not in named]:
        del ref["ceilings"][name]
    # A run that left them empty keeps the file's.
    for key in ("toolkit", "cuda_runtime"):
        if run.get(key):
            ref[key] = run[key]
    write(a.into, ref)
    print(f"merge_reference: {', '.join(sorted(measured))} from {a.run} ({run['date']}, seed {run['seed']}) into {a.into}")


if __name__ == "__main__":
    main()
