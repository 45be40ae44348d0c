#!/usr/bin/env python3
"""Grades a whole class: every student's folder of SUBMISSIONS with `k2c grade --submission`, one
after another into one build folder, and writes the scores as a table.

    python3 tools/grade_class.py SUBMISSIONS OUT [--k2c PATH] [--root COURSE] [--regrade]
                                 [-- more k2c grade options, e.g. --modules 11,12 --seed 7]

SUBMISSIONS holds one folder per student, named after the student (letters, digits, '.', '_',
'-'); each is graded as `k2c grade --submission` grades one student's files. OUT receives
    reports/NAME.json   k2c's full report of each student
    logs/NAME.log       what k2c printed while grading that student
    scores.csv          one row per student: the total, then each module's points
    scores.png          each module's scores across the class, a dot per student (with matplotlib)
    build/              the build folder every grading shares
Sharing the build folder is what makes a class quick: k2c stages each submission over the last one,
rewriting only the files whose bytes differ, so each student's build recompiles their own files
and not the course (where code under test runs as the grader's own user, k2c builds everything
again, and this is only as quick as grading each alone).

Every student's folder is copied first, before any code runs, into a folder of the grader's own
(0700) that is removed at the end, and graded from there: code under test of an earlier student
(run as an unprivileged account, see docs/SECURITY.md) cannot rewrite a later student's files,
however loose the permissions an upload arrived with. Only folders, plain files and links are
copied (links stay links, which k2c refuses); a pipe or a device is left out, as k2c would not
take it.

A student whose report is already in OUT is not graded again unless --regrade is given, so an
interrupted class picks up where it stopped. A grading that k2c could not finish for one student
(its status 2, or no report) is listed and the class goes on; a grading stopped because the
course tree changed under it (status 1 with that message) stops the class, since nothing graded
after it could be trusted.
"""
import argparse
import csv
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="%(prog)s SUBMISSIONS OUT [options] [-- k2c grade options]")
    ap.add_argument("submissions", type=pathlib.Path, help="one folder per student")
    ap.add_argument("out", type=pathlib.Path, help="reports, logs, scores.csv and the shared build folder")
    root = pathlib.Path(__file__).resolve().parent.parent
    ap.add_argument("--root", type=pathlib.Path, default=root, help="the course tree (default: this one)")
    ap.add_argument("--k2c", type=pathlib.Path, default=None,
                    help="the grader (default: the course's build/*/bin/k2c, solutions' first)")
    ap.add_argument("--regrade", action="store_true", help="grade again students who already have a report")
    # What follows `--` is k2c grade's, taken aside before argparse sees it.
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.grade_args = extra
    return args


def find_k2c(args):
    if args.k2c:
        if not args.k2c.is_file() or not os.access(args.k2c, os.X_OK):
            sys.exit(f"grade_class: --k2c {args.k2c}: no such program")
        return args.k2c
    for impl in ("solutions", "assignments"):
        k2c = args.root / "build" / impl / "bin" / "k2c"
        if k2c.is_file():
            return k2c
    sys.exit("grade_class: no k2c in build/solutions or build/assignments: run `make build` or pass --k2c")


def students(folder):
    """The students' folders, by name, and the entries passed over with the reason."""
    if not folder.is_dir():
        sys.exit(f"grade_class: {folder} is not a folder")
    found, passed_over = [], []
    for entry in sorted(folder.iterdir()):
        if entry.is_symlink() or not entry.is_dir():
            passed_over.append((entry.name, "not a folder"))
        elif not NAME.match(entry.name):
            passed_over.append((entry.name, "a name with characters other than letters, digits, '.', '_', '-'"))
        else:
            found.append(entry)
    return found, passed_over


MAX_DEPTH = 64  # folders deeper than this in an upload are refused (a course tree is a few deep)


def copy_folder(src, dst):
    """Copies the folders, plain files and links under src into dst (made here), without
    recursion: an upload nested hundreds of folders deep must not stop the class. Raises OSError
    with the reason when it cannot."""
    todo = [(pathlib.Path(src), pathlib.Path(dst), 0)]
    while todo:
        source, target, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise OSError(f"folders nested more than {MAX_DEPTH} deep")
        target.mkdir(mode=0o700)
        for entry in os.scandir(source):
            at, to = pathlib.Path(entry.path), target / entry.name
            if entry.is_symlink():
                os.symlink(os.readlink(at), to)
            elif entry.is_dir(follow_symlinks=False):
                todo.append((at, to, depth + 1))
            elif entry.is_file(follow_symlinks=False):
                shutil.copy2(at, to, follow_symlinks=False)


def snapshot(found):
    """Every student's folder copied into a fresh 0700 folder of this process's; returns it and,
    in the order given, each copy, or the reason it could not be made (an unreadable file, folders
    nested too deep): that student is reported as not graded, the others are graded."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="k2c-class-"))
    copies = []
    for student in found:
        try:
            copy_folder(student, root / student.name)
            copies.append(root / student.name)
        except (OSError, shutil.Error) as e:
            shutil.rmtree(root / student.name, ignore_errors=True)
            copies.append(f"could not copy the upload: {e}")
    return root, copies


def whole(report):
    """A report of a grading that ran to its end, with what scores.csv reads."""
    return (isinstance(report, dict) and not report.get("unfinished")
            and all(isinstance(report.get(k), (int, float)) for k in ("points", "max_points"))
            and isinstance(report.get("modules"), list)
            and all(isinstance(m, dict) and isinstance(m.get("id"), str)
                    and all(isinstance(m.get(k), (int, float)) for k in ("points", "max_points"))
                    for m in report["modules"]))


def grade(k2c, args, student, out):
    """Runs k2c for one student; returns (report or None, why there is none, stop the class)."""
    report_path, log_path = out / "reports" / f"{student.name}.json", out / "logs" / f"{student.name}.log"
    report_path.unlink(missing_ok=True)
    cmd = [str(k2c), "--root", str(args.root), "grade", "--submission", str(student),
           "--build-dir", str(out / "build"), "--json", str(report_path), *args.grade_args]
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        status = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    text = log_path.read_text(errors="replace")
    if status == 1 and "changed while grading" in text:
        return None, "the course tree changed while grading: " + text.strip().splitlines()[-1], True
    last = text.strip().splitlines()[-1] if text.strip() else "no output"
    # Status 2 that is not about the submission, or CLI11's own (100 and up), is k2c refusing the
    # arguments this script passes every student: no student would fare better.
    if (status == 2 and not last.startswith("k2c: submission")) or status >= 100:
        return None, f"k2c refused its arguments (status {status}): {last}", True
    try:
        report = json.loads(report_path.read_text())
    except (OSError, json.JSONDecodeError):
        report = None
    if not whole(report):
        # k2c rewrites the report after each module; one marked unfinished is from a run that
        # stopped before the end, and is no grade.
        report_path.unlink(missing_ok=True)
        return None, f"k2c exited with status {status} and wrote no whole report ({last})", False
    return report, "", False


def main():
    args = parse_args()
    k2c = find_k2c(args)
    found, passed_over = students(args.submissions)
    for name, why in passed_over:
        print(f"passed over: {name}: {why}")
    if not found:
        sys.exit(f"grade_class: no student folders in {args.submissions}")
    out = args.out
    for sub in ("reports", "logs", "build"):
        (out / sub).mkdir(parents=True, exist_ok=True)

    snapshot_root = None
    try:
        snapshot_root, copies = snapshot(found)
        return grade_all(k2c, args, found, copies, passed_over, out)
    finally:
        if snapshot_root:
            shutil.rmtree(snapshot_root, ignore_errors=True)


def grade_all(k2c, args, found, copies, passed_over, out):
    """Grades each student from its copy; writes scores.csv and the plot."""
    reports, problems = {}, {}
    for i, (student, copy) in enumerate(zip(found, copies), 1):
        tag = f"[{i}/{len(found)}] {student.name}"
        kept = out / "reports" / f"{student.name}.json"
        if kept.is_file() and not args.regrade:
            try:
                report = json.loads(kept.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                report = None
            if whole(report):  # else unreadable, or from a run that stopped early: graded again
                reports[student.name] = report
                print(f"{tag}: kept from an earlier run ({report['points']:g} points)", flush=True)
                continue
        if isinstance(copy, str):  # the upload could not be copied
            problems[student.name] = copy
            print(f"{tag}: not graded: {copy}", flush=True)
            continue
        start = time.monotonic()
        report, why, stop = grade(k2c, args, copy, out)
        seconds = time.monotonic() - start
        if stop:
            sys.exit(f"{tag}: {why}\ngrade_class: stopped; fix that and run again "
                     f"(students already graded keep their reports)")
        if report is None:
            problems[student.name] = why
            print(f"{tag}: not graded: {why} (logs/{student.name}.log)", flush=True)
            continue
        reports[student.name] = report
        print(f"{tag}: {report['points']:g}/{report['max_points']:g} points ({seconds:.0f} s)", flush=True)

    # scores.csv: the modules in the order the reports list them, each student's points.
    modules = []
    for r in reports.values():
        for m in r["modules"]:
            if m["id"] not in modules:
                modules.append(m["id"])
    with open(out / "scores.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["student", "points", "max_points", *modules, "problem"])
        for student in found:
            r = reports.get(student.name)
            if r is None:
                w.writerow([student.name, "", "", *[""] * len(modules), problems.get(student.name, "")])
                continue
            by_id = {m["id"]: m["points"] for m in r["modules"]}
            w.writerow([student.name, f"{r['points']:g}", f"{r['max_points']:g}",
                        *[f"{by_id[m]:g}" if m in by_id else "" for m in modules], ""])
    print(f"wrote {out / 'scores.csv'}: {len(reports)} graded, {len(problems)} not graded, "
          f"{len(passed_over)} passed over")
    plot(reports, modules, out / "scores.png")
    return 1 if problems else 0


def plot(reports, modules, png):
    """Each module's share of its points across the class: a dot per student (spread sideways so
    equal scores stay visible) and a bar at the class mean."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no matplotlib here (Debian: python3-matplotlib): {png.name} not drawn")
        return
    if not reports or not modules:
        return
    fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(modules) + 2), 4))
    for x, module in enumerate(modules):
        shares = []
        for r in reports.values():
            m = next((m for m in r["modules"] if m["id"] == module), None)
            if m and m["max_points"] > 0:
                shares.append(100 * m["points"] / m["max_points"])
        if not shares:
            continue
        spread = [x + 0.3 * ((i * 0.618) % 1 - 0.5) for i in range(len(shares))]
        ax.scatter(spread, shares, s=14, alpha=0.7, color="tab:blue", zorder=3)
        mean = sum(shares) / len(shares)
        ax.hlines(mean, x - 0.35, x + 0.35, color="tab:orange", lw=2, zorder=4)
    ax.set_xticks(range(len(modules)))
    ax.set_xticklabels(modules, rotation=45, ha="right", fontsize=8)
    ax.set_ylim(-5, 105)
    ax.set_ylabel("points earned (% of the module's)")
    ax.set_title(f"{len(reports)} students: a dot each, the class mean in orange", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    sys.exit(main())
