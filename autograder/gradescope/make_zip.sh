#!/usr/bin/env bash
# make_zip.sh OUT.zip — the Gradescope autograder bundle: setup.sh and run_autograder at the top,
# the course tree (without solutions/) under source/.
set -euo pipefail
out=$(realpath -m "${1:?usage: make_zip.sh OUT.zip}")
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
k2c=$(ls "$root"/build/*/bin/k2c 2>/dev/null | head -1)
[ -n "$k2c" ] || { echo "build k2c first (make build)"; exit 1; }
"$k2c" --root "$root" handout "$stage/source" >/dev/null
cp "$here/setup.sh" "$here/run_autograder" "$stage/"
(cd "$stage" && zip -qr "$out" .)
echo "wrote $out"
