#!/usr/bin/env python3
"""leakcheck.py PROJECT HANDOUT — fail when a student handout carries reference-solution code.

PROJECT is the course tree with solutions/, HANDOUT a tree written by `k2c handout`. Two checks:

* Copied lines. A line of a file under PROJECT/solutions counts when, stripped of the whitespace
  around it, it is at least 50 characters long and appears in no stub (PROJECT/assignments) and
  nowhere under PROJECT/common: those ship anyway, so a line they share with a solution gives
  nothing away (a contract's declaration, a call into the harness); shorter lines are too
  common to tell. Comments count too: a solution's explanation is part of it. Every handout
  file is searched for these lines.
* Includes. A handout file that #includes a path through solutions/ was written against the
  reference code (a research program of lab/); it would not even build in the handout.

Exit status 1, and each finding as FILE:LINE, when either check finds anything; 0 otherwise.
Used by autograder/selftest/handout_test.sh; the folders a handout leaves out (solutions/, lab/)
are listed in copy_course (autograder/k2c/intake.cpp).
"""
import os
import re
import sys

MIN_CHARS = 50

# Teaching text that quotes a solution on purpose, with the reason; what it quotes is reported
# as a note, not a failure. Anything else that matches fails.
QUOTED_ON_PURPOSE = {
    "lectures/01_naive_matmul.md": "section 5 walks through the naive kernel line by line",
}

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^">]*)[">]')


def files_under(root):
    """Every regular file below root (links are not followed: a handout must hold its code)."""
    for folder, subfolders, names in os.walk(root):
        subfolders.sort()  # a fixed order: a line found in two solutions is named by the first
        for name in sorted(names):
            path = os.path.join(folder, name)
            if os.path.isfile(path) and not os.path.islink(path):
                yield path


def numbered_lines(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                yield number, line
    except OSError:
        return


def long_lines(path):
    return {s for _, line in numbered_lines(path) if len(s := line.strip()) >= MIN_CHARS}


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: leakcheck.py PROJECT HANDOUT")
    project, handout = sys.argv[1], sys.argv[2]
    solutions = os.path.join(project, "solutions")
    if not os.path.isdir(solutions):
        sys.exit(f"leakcheck: {solutions} is not a folder: nothing to check against")

    public = set()
    for tree in ("assignments", "common"):
        for path in files_under(os.path.join(project, tree)):
            public |= long_lines(path)
    secret = {}  # line -> the solution file it comes from
    for path in files_under(solutions):
        for line in long_lines(path) - public:
            secret.setdefault(line, os.path.relpath(path, project))

    failures, notes = [], []
    for path in files_under(handout):
        rel = os.path.relpath(path, handout)
        for number, line in numbered_lines(path):
            text = line.strip()
            if text in secret:
                finding = f"{rel}:{number}: copies {secret[text]}: {text[:100]}"
                if rel in QUOTED_ON_PURPOSE:
                    notes.append(f"{finding}  [{QUOTED_ON_PURPOSE[rel]}]")
                else:
                    failures.append(finding)
            include = INCLUDE.match(line)
            if include and re.search(r"(^|/)solutions/", include.group(1)):
                failures.append(f"{rel}:{number}: includes {include.group(1)}")

    for note in notes:
        print("leakcheck: note (quoted on purpose):", note)
    for failure in failures:
        print("leakcheck: LEAK", failure)
    print(f"leakcheck: {len(failures)} finding(s) in {handout} "
          f"({len(secret)} solution lines checked, {len(notes)} quoted on purpose)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
