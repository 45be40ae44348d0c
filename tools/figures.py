#!/usr/bin/env python3
"""Measured figures in the docs, generated from the reference file and checked against it.

    tools/figures.py --write [--reference FILE] [FILE.md ...]   rewrite every figure and table
    tools/figures.py --check [--reference FILE] [--without DIR] [FILE.md ...]
                                                                exit 1, naming file:line of each
                                                                stale or broken one

Every number in a lecture, a handout or the README that was measured on the reference GPU lives
in `autograder/reference/h200.json` (graded runs, benchmark sweeps) or in
`lab/results/h200.json` (the research programs of lab/), or, for the runs made on an H100, in their
H100 counterparts (`autograder/reference/h100.json`, `lab/results/h100.json`), and nowhere else. The
Markdown holds a marker around it, and
this tool writes what sits between the markers. Markers are HTML comments, so they do not show
when the Markdown is rendered:

  <!--fig:PATH|FMT-->VALUE<!--/fig-->
      One number. PATH walks the reference file: keys joined by '/', a whole number indexing a
      list (`modules/06_softmax/SoftmaxPerf.FastVsCopy/ratio`,
      `collectives/2_final/results/9/busbw_gbs`). A key that itself holds a '/' (`TFLOP/s`)
      is written as it is. FMT is a Python format spec (`.3f`, `.0f`, `,.0f`, `.1%`); without
      `|FMT` the value is written with `.3g`. VALUE is what the tool writes.

  <!--fig:PATH ÷ PATH|FMT-->VALUE<!--/fig-->
      The quotient of two figures (each PATH as above, either may name a FILE.json): a rate over
      the ceiling measured beside it, where the reference file keeps both but not their ratio.
      Either side may be a stated constant instead (`137.4 ÷ PATH`: GFLOPs over TFLOP/s, in ms).

  <!--fig:FILE.json:PATH|FMT-->VALUE<!--/fig-->
      The same, read from another JSON file of the course tree, named by its path from the
      top (`lab/results/h200.json:row_streams/copies/...`): what the research programs of lab/
      measured lives there, apart from the graded runs.

  <!--table:ID-->
  ...
  <!--/table-->
      A whole table, rewritten. ID is a module id (`06_softmax`: that module's performance tests,
      with achieved rate, ceiling of the same run, ratio, the rubric's student bar and goal), `all`
      (every module's tests, the README's results table) or a GEMM ladder
      (`gemm_ladder/sgemm`, `gemm_ladder/bf16gemm`: TFLOP/s by size and version), read from the
      reference file, or from another of the course tree where ID starts with its path
      (`autograder/reference/h100.json:all`: another GPU's graded runs).

Without FILE arguments the tool scans every Markdown file of the course tree (build trees and
hidden folders apart). Markers inside code (backticks or fenced blocks) are examples, left alone.
`make figures` runs --write; `make test` runs --check (CTest `docs.figures`). A tree shipped
without a folder (a student handout has no lab/) passes `--without lab`: figures read from files
under it, where those files are absent, are left as written and counted as unchecked; anywhere
else a missing file is an error. Standard library only.
"""
import argparse
import json
import os
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SKIP_DIRS = {"build", "out", "node_modules", "__pycache__"}

FIG = re.compile(r"<!--fig:(?P<spec>[^\n]*?)-->(?P<value>[^<\n]*)<!--/fig-->")
FIG_OPEN = re.compile(r"<!--fig:")
TABLE = re.compile(r"(?P<open><!--table:(?P<id>[^>]*?)-->\n)(?P<body>.*?)(?P<close><!--/table-->)", re.S)
TABLE_OPEN = re.compile(r"<!--table:")

LADDERS = {
    "sgemm": ("SGEMM ladder", [("cublas", "0 cuBLAS"), ("naive", "1 naive"), ("coalesced", "2 coalesced"),
                               ("tile32", "3a tile 32x32"), ("tiled", "3 tiled"),
                               ("register_tiled", "4 register-tiled")], [("register_tiled", "4 / cuBLAS")]),
    "bf16gemm": ("bf16 tensor-core ladder", [("cublas", "0 cuBLAS bf16"), ("mma_sync", "5A mma.sync"),
                                             ("wgmma", "5B wgmma")],
                 [("mma_sync", "5A / cuBLAS"), ("wgmma", "5B / cuBLAS")]),
}


class FigureError(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# Looking a path up in the reference file

def lookup(node, parts, path):
    """The value at `parts` below `node`. Keys may hold '/', so at each level every way of
    joining the next components into one key is tried, shortest first."""
    if not parts:
        return node
    if isinstance(node, list):
        if not parts[0].isdigit() or int(parts[0]) >= len(node):
            raise FigureError(f"{path}: '{parts[0]}' is not an index of a list of {len(node)}")
        return lookup(node[int(parts[0])], parts[1:], path)
    if isinstance(node, dict):
        for n in range(1, len(parts) + 1):
            key = "/".join(parts[:n])
            if key in node:
                try:
                    return lookup(node[key], parts[n:], path)
                except FigureError:
                    if n == len(parts):
                        raise
                    continue
        raise FigureError(f"{path}: no key '{parts[0]}' here (keys: {', '.join(sorted(node)[:8])}"
                          f"{', ...' if len(node) > 8 else ''})")
    raise FigureError(f"{path}: '{parts[0]}' goes below a {type(node).__name__} value")


# A marker that reads another file than the reference names it by its path from the top of the
# tree, then ':' (no key of the reference file looks like that).
NAMED = re.compile(r"(?P<file>[\w.-]+(?:/[\w.-]+)*\.json):(?P<path>.*)", re.S)


class Unchecked(Exception):
    """A figure from a file under a folder this tree was shipped without (--without)."""


class References:
    """The reference file and the other files markers name, each read once."""

    def __init__(self, default, without=(), default_name="autograder/reference/h200.json"):
        self.default = default
        self.default_name = default_name
        self.without = [d.strip("/") for d in without]
        self.named = {}

    def split(self, path):
        """(the JSON a marker's PATH reads, the PATH within it)."""
        m = NAMED.fullmatch(path)
        if not m:
            return self.default, path
        name = m.group("file")
        if name not in self.named:
            if ".." in name.split("/"):
                raise FigureError(f"{name}: a file outside the course tree")
            file = ROOT / name
            if not file.is_file():
                if any(name.startswith(d + "/") for d in self.without):
                    raise Unchecked(name)
                raise FigureError(f"{name}: no such file in the course tree")
            try:
                self.named[name] = json.loads(file.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise FigureError(f"{name}: not JSON: {e}")
        return self.named[name], m.group("path")


def number_at(refs, path):
    ref, path = refs.split(path.strip())
    return lookup(ref, [p for p in path.split("/") if p != ""], path), path


def constant_or_number_at(refs, side):
    """A side of a ratio: a figure's PATH, or a stated constant (a datasheet peak, a FLOP count)."""
    try:
        return float(side)
    except ValueError:
        return number_at(refs, side)[0]


def render_fig(refs, spec):
    path, _, fmt = spec.rpartition("|") if "|" in spec else (spec, "", "")
    path, fmt = path.strip(), fmt.strip() or ".3g"
    if " ÷ " in path:  # a ratio of two measured figures, e.g. a rate over the same run's copy
        top, bottom = (constant_or_number_at(refs, p) for p in path.split(" ÷ ", 1))
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (top, bottom)) or bottom == 0:
            raise FigureError(f"{path}: a ratio needs two numbers, the second not zero")
        return format(top / bottom, fmt)
    value, path = number_at(refs, path)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise FigureError(f"{path}: a {type(value).__name__}, not a number or a string")
    if isinstance(value, str):
        return value if fmt == ".3g" else format(value, fmt)
    try:
        return format(value, fmt)
    except ValueError as e:
        raise FigureError(f"{path}: format '{fmt}': {e}")


# ---------------------------------------------------------------------------------------------
# Tables

def num(x):
    """Figures in tables: four significant digits, no exponent."""
    return f"{x:.4g}" if abs(x) < 1e4 else f"{x:.0f}"


def rubric_perf(rubric):
    """(module, test) -> the rubric's perf entry and points."""
    return {(m["id"], t["name"]): (t["perf"], t["points"], t.get("bonus", False))
            for m in rubric["modules"] for t in m["tests"] if "perf" in t}


def goal_cells(perf):
    """Student bar and goal of one test; tests worth no points only record a figure."""
    if perf is None:
        return "", ""
    p, points, bonus = perf
    if points <= 0:
        return "recorded", "recorded"
    tag = " (bonus)" if bonus else ""
    return f"{p['threshold']:.3g}{tag}", f"{p['goal']:.3g}"


def measured_on(ref, module=None):
    date = ref.get("module_dates", {}).get(module, ref["date"]) if module else ref["date"]
    toolkit = ref.get("toolkit") or f"CUDA runtime {ref.get('cuda_runtime')}"
    return f"{ref['gpu']}, {toolkit}, measured {date}"


def result_row(lead, r, perf, bar_column):
    """One table row of a recorded test: the lead cells, then achieved, ceiling (with its name),
    ratio, the student bar (where the table has that column) and goal."""
    bar, goal = goal_cells(perf)
    cells = lead + [f"{num(r['achieved'])} {r['unit']}", f"{num(r['ceiling'])} {r['unit']} ({r['ceiling_name']})",
                    f"{r['ratio']:.3f}"] + ([bar] if bar_column else []) + [goal]
    return "| " + " | ".join(cells) + " |"


def table_module(ref, rubric, module, source):
    tests = ref.get("modules", {}).get(module)
    if not tests:
        raise FigureError(f"table '{module}': no module of that id in the reference file")
    perf = rubric_perf(rubric)
    rows = [f"{measured_on(ref, module)} (`{source}`):", "",
            "| test | achieved | ceiling (same run) | ratio | student bar | goal |",
            "|---|---:|---|---:|---:|---:|"]
    for name, r in sorted(tests.items()):
        rows.append(result_row([f"`{name}`"], r, perf.get((module, name)), bar_column=True))
    return rows


def table_all(ref, rubric):
    perf = rubric_perf(rubric)
    later = "".join(f"; {m}: {d}" for m, d in sorted(ref.get("module_dates", {}).items()))
    rows = [f"{measured_on(ref)}{later}.", "",
            "| module | test | achieved | ceiling (same run) | ratio | goal |",
            "|---|---|---|---|---|---|"]
    for module, tests in sorted(ref["modules"].items()):
        for name, r in sorted(tests.items()):
            rows.append(result_row([module, name], r, perf.get((module, name)), bar_column=False))
    return rows


def table_ladder(ref, which):
    if which not in LADDERS:
        raise FigureError(f"table 'gemm_ladder/{which}': ladders are {', '.join(LADDERS)}")
    ladder = ref.get("gemm_ladder", {})
    rates = ladder.get("results", {}).get(which)
    if not rates:
        raise FigureError(f"table 'gemm_ladder/{which}': no such results in the reference file")
    title, variants, ratios = LADDERS[which]
    variants = [(v, label) for v, label in variants if v in rates]
    ratios = [(v, label) for v, label in ratios if v in rates]
    sizes = sorted({int(n) for v, _ in variants for n in rates[v]})
    cublas = rates.get("cublas", {})
    rows = [f"{title} on {ladder.get('gpu', ref['gpu'])}, TFLOP/s (Google Benchmark: CUDA-event time of each run after an L2 flush, mean of 3 to 10 runs):", "",
            "| n | " + " | ".join(label for _, label in variants + ratios) + " |",
            "|" + "---|" * (len(variants) + len(ratios) + 1)]
    for n in sizes:
        cells = [f"{rates[v][str(n)]:.2f}" if str(n) in rates[v] else "" for v, _ in variants]
        for v, _ in ratios:
            r, c = rates[v].get(str(n)), cublas.get(str(n))
            cells.append(f"{100 * r / c:.0f}%" if r and c else "")
        rows.append(f"| {n} | " + " | ".join(cells) + " |")
    return rows


def render_table(refs, rubric, table_id):
    """A table's rows, from the reference file or from the FILE.json that its id starts with."""
    ref, table_id = refs.split(table_id.strip())
    source = next((name for name, j in refs.named.items() if j is ref), refs.default_name)
    if table_id == "all":
        rows = table_all(ref, rubric)
    elif table_id.startswith("gemm_ladder/"):
        rows = table_ladder(ref, table_id.split("/", 1)[1])
    else:
        rows = table_module(ref, rubric, table_id, source)
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------------------------------------
# Files

def markdown_files(root):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for f in sorted(filenames):
            if f.endswith(".md"):
                yield pathlib.Path(dirpath) / f


def line_of(text, pos):
    return text.count("\n", 0, pos) + 1


FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]+`")


def code_spans(text):
    """Fenced blocks and inline code: markers shown there as examples are text, not figures."""
    spans = [m.span() for m in FENCE.finditer(text)]
    spans += [m.span() for m in INLINE_CODE.finditer(text)
              if not any(a <= m.start() < b for a, b in spans)]
    return spans


def in_code(spans, pos):
    return any(a <= pos < b for a, b in spans)


def process(path, refs, rubric, write, shown):
    """(markers, markers left unchecked, problems) of one file, after rewriting it with write."""
    text = path.read_text(encoding="utf-8")
    if "<!--fig:" not in text and "<!--table:" not in text:
        return 0, 0, []
    problems, count, unchecked = [], 0, 0
    code = code_spans(text)

    def fig(m):
        nonlocal count, unchecked
        if in_code(code, m.start()):
            return m.group(0)
        count += 1
        where = f"{shown}:{line_of(text, m.start())}"
        try:
            want = render_fig(refs, m.group("spec"))
        except Unchecked:
            unchecked += 1
            return m.group(0)
        except FigureError as e:
            problems.append(f"{where}: {e}")
            return m.group(0)
        if m.group("value") != want:
            if not write:
                problems.append(f"{where}: stale figure {m.group('spec')}: the text says "
                                f"'{m.group('value')}', the reference file gives '{want}'")
            return f"<!--fig:{m.group('spec')}-->{want}<!--/fig-->"
        return m.group(0)

    def table(m):
        nonlocal count, unchecked
        if in_code(code, m.start()):
            return m.group(0)
        count += 1
        where = f"{shown}:{line_of(text, m.start())}"
        try:
            want = render_table(refs, rubric, m.group("id"))
        except Unchecked:
            unchecked += 1
            return m.group(0)
        except FigureError as e:
            problems.append(f"{where}: {e}")
            return m.group(0)
        if m.group("body") != want:
            if not write:
                old, new_rows = m.group("body").splitlines(), want.splitlines()
                first = next((i for i, (a, b) in enumerate(zip(old, new_rows)) if a != b),
                             min(len(old), len(new_rows)))
                shown_row = new_rows[first] if first < len(new_rows) else "(fewer rows)"
                problems.append(f"{shown}:{line_of(text, m.start()) + 1 + first}: stale table "
                                f"'{m.group('id')}': the file gives {shown_row}")
            return m.group("open") + want + m.group("close")
        return m.group(0)

    new = TABLE.sub(table, text)
    code = code_spans(new)
    new = FIG.sub(fig, new)
    code = code_spans(new)
    # A marker that opens and never closes would hide text from the reader: report it.
    for opener, closed, what in ((FIG_OPEN, FIG, "fig"), (TABLE_OPEN, TABLE, "table")):
        complete = {m.start() for m in closed.finditer(new)}
        for m in opener.finditer(new):
            if m.start() not in complete and not in_code(code, m.start()):
                problems.append(f"{shown}:{line_of(new, m.start())}: <!--{what}:...--> without its "
                                f"closing <!--/{what}--> (a table's opening marker ends its line)")
    if write and new != text:
        path.write_text(new, encoding="utf-8")
    problems.sort(key=lambda p: int(p.split(":")[1]) if p.split(":")[1].isdigit() else 0)
    return count, unchecked, problems


def read_object(path, option):
    """The JSON object in a file given by `option`, or the end of the run with a message saying what is wrong."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        sys.exit(f"figures.py: {option} {path}: {e}")
    if not isinstance(data, dict):
        sys.exit(f"figures.py: {option} {path}: a JSON object expected, found {type(data).__name__}")
    return data


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite every figure and table")
    mode.add_argument("--check", action="store_true", help="exit 1 if any figure or table is stale")
    ap.add_argument("--reference", default=str(ROOT / "autograder/reference/h200.json"))
    ap.add_argument("--rubric", default=str(ROOT / "autograder/rubric.json"))
    ap.add_argument("--without", action="append", default=[], metavar="DIR",
                    help="this tree was shipped without DIR (a handout without lab/): figures "
                         "from files under it are left unchecked")
    ap.add_argument("files", nargs="*", help="Markdown files (default: the whole course tree)")
    args = ap.parse_args(argv)

    reference = pathlib.Path(args.reference).resolve()
    try:
        reference_name = str(reference.relative_to(ROOT))
    except ValueError:
        reference_name = str(reference)
    refs = References(read_object(reference, "--reference"), args.without, reference_name)
    rubric = read_object(pathlib.Path(args.rubric), "--rubric")
    files = [pathlib.Path(f) for f in args.files] or list(markdown_files(ROOT))
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        sys.exit(f"figures.py: no such Markdown file: {', '.join(missing)}")
    total, unchecked, problems, touched = 0, 0, [], 0
    for path in files:
        try:
            shown = path.resolve().relative_to(ROOT)
        except ValueError:
            shown = path
        count, skipped, found = process(path, refs, rubric, args.write, shown)
        total += count
        unchecked += skipped
        touched += count > 0
        problems += found
    for p in problems:
        print(p, file=sys.stderr)
    verb = "written" if args.write else "checked"
    sources = ", ".join([pathlib.Path(args.reference).name] + sorted(refs.named))
    left = f" ({unchecked} left unchecked: their files are not in this tree)" if unchecked else ""
    print(f"figures.py: {total} figures and tables in {touched} files {verb} against "
          f"{sources}{left}; {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
