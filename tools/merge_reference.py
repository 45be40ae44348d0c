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
"""
import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="the file `k2c grade --write-reference` wrote")
    ap.add_argument("--into", default=str(ROOT / "autograder/reference/h200.json"))
    a = ap.parse_args()
    try:
        run = json.loads(pathlib.Path(a.run).read_text())
        ref = json.loads(pathlib.Path(a.into).read_text())
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"merge_reference: {e}")
    for key in ("gpu", "date", "seed", "modules"):
        if key not in run:
            sys.exit(f"merge_reference: {a.run} has no '{key}': not a file `k2c grade --write-reference` wrote")
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
    for key in ("toolkit", "cuda_runtime"):
        if key in run:
            ref[key] = run[key]
    pathlib.Path(a.into).write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n")
    print(f"merge_reference: {', '.join(sorted(measured))} from {a.run} ({run['date']}, seed {run['seed']}) into {a.into}")


if __name__ == "__main__":
    main()
