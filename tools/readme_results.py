#!/usr/bin/env python3
"""Regenerate the README's results table from a reference-timings file.

    tools/readme_results.py [autograder/reference/h200.json] [README.md]

Rewrites the lines between <!-- results:begin --> and <!-- results:end --> with one row per
performance test: achieved figure, the ceiling measured in the same run, the ratio, and the
rubric's goal. Uses only the standard library.
"""
import json
import pathlib
import re
import sys

root = pathlib.Path(__file__).resolve().parent.parent
ref_path = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else root / "autograder/reference/h200.json"
readme = pathlib.Path(sys.argv[2]) if len(sys.argv) > 2 else root / "README.md"
ref = json.loads(ref_path.read_text())
rubric = json.loads((root / "autograder/rubric.json").read_text())
# The goal column; tests worth no points only record a figure.
goals = {(m["id"], t["name"]): (t["perf"]["goal"] if t["points"] > 0 else "recorded")
         for m in rubric["modules"] for t in m["tests"] if "perf" in t}

# Modules graded in a later run than the rest carry their own date.
later = "".join(f"; {m}: {d}" for m, d in sorted(ref.get("module_dates", {}).items()))
rows = [f"{ref['gpu']}, {ref['toolkit'] or 'CUDA runtime ' + str(ref['cuda_runtime'])}, "
        f"measured {ref['date']}{later}.", "",
        "| module | test | achieved | ceiling (same run) | ratio | goal |",
        "|---|---|---|---|---|---|"]
for module, tests in sorted(ref["modules"].items()):
    for name, r in sorted(tests.items()):
        goal = goals.get((module, name))
        rows.append(f"| {module} | {name} | {r['achieved']:.4g} {r['unit']} | "
                    f"{r['ceiling']:.4g} {r['unit']} ({r['ceiling_name']}) | {r['ratio']:.3f} | "
                    f"{'' if goal is None else goal if isinstance(goal, str) else f'{goal:.3g}'} |")

text = readme.read_text()
new, n = re.subn(r"(<!-- results:begin -->\n).*?(<!-- results:end -->)",
                 lambda m: m.group(1) + "\n".join(rows) + "\n" + m.group(2), text, flags=re.S)
if n != 1:
    sys.exit(f"{readme}: results markers not found")
readme.write_text(new)
print(f"{readme}: {len(rows) - 4} rows from {ref_path}")
