#!/usr/bin/env bash
# make_zip.sh OUT.zip [K2C] — the Gradescope autograder bundle, laid out as Gradescope's autograder
# specification asks: setup.sh and run_autograder at the root of the zip, beside the course tree
# (without solutions/). Gradescope extracts the whole zip into /autograder/source, so the Makefile
# and CMakeLists.txt land there, where both scripts look for them.
# K2C is the k2c that writes the course tree (default: $K2C, else the first build/*/bin/k2c).
set -euo pipefail
out=$(realpath -m "${1:?usage: make_zip.sh OUT.zip [K2C]}")
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
k2c=${2:-${K2C:-}}
[ -n "$k2c" ] || k2c=$(ls "$root"/build/*/bin/k2c 2>/dev/null | head -1 || true)
[ -n "$k2c" ] && [ -x "$k2c" ] || { echo "make_zip.sh: build k2c first (make build), or pass its path"; exit 1; }
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
"$k2c" --root "$root" handout "$stage/course" >/dev/null
cp "$here/setup.sh" "$here/run_autograder" "$stage/course/"
chmod 755 "$stage/course/setup.sh" "$stage/course/run_autograder"
# zip adds to an existing archive: start from nothing, or files deleted since would stay in it.
rm -f "$out"
if command -v zip >/dev/null; then
  (cd "$stage/course" && zip -qr "$out" .)
else
  # Python's zipfile keeps the Unix modes too (run_autograder must stay executable).
  python3 - "$stage/course" "$out" <<'PY'
import os, sys, zipfile
src, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
    for d, dirs, files in os.walk(src):
        dirs.sort()
        for f in sorted(files):
            path = os.path.join(d, f)
            z.write(path, os.path.relpath(path, src))
PY
fi
echo "wrote $out"
