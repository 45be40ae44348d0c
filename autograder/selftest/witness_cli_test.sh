#!/usr/bin/env bash
# witness_cli_test.sh K2C_WITNESS WORKDIR — what k2c_witness says before any test program runs:
# bad arguments end it with status 2 and a usage line; an unknown witness, and (on a machine
# without a CUDA device) a known one, give a verdict whose fault is the grader's, which the grader
# reads as "not witnessed" rather than against the submission. With a device: skipped (77), the
# GPU's side is witness_test.sh's.
set -euo pipefail
witness=$1
work=$2
rm -rf "$work"
mkdir -p "$work"
fail() { echo "FAIL: $*"; exit 1; }

status=0
"$witness" > "$work/usage.txt" 2>&1 || status=$?
[ "$status" = 2 ] && grep -q "usage: k2c_witness NAME --out FILE" "$work/usage.txt" || fail "no usage line (status $status)"
status=0
"$witness" copy --out "$work/v.json" --frobnicate -- true > "$work/bad.txt" 2>&1 || status=$?
[ "$status" = 2 ] && grep -q "unknown option --frobnicate" "$work/bad.txt" || fail "an unknown option was not refused"
status=0
"$witness" copy --out "$work/v.json" --shapes 1000 -- true > "$work/bad.txt" 2>&1 || status=$?
[ "$status" = 2 ] && grep -q -- "--shapes: expected 0 to 64" "$work/bad.txt" || fail "--shapes 1000 was not refused"
status=0
"$witness" copy --out "$work/v.json" --ceiling > "$work/bad.txt" 2>&1 || status=$?
[ "$status" = 2 ] && grep -q -- "--ceiling needs a value" "$work/bad.txt" || fail "--ceiling without a name was not refused"

"$witness" no_such_witness --out "$work/unknown.json" -- true
grep -q '"fault": "grader"' "$work/unknown.json" && grep -q "has no witness named 'no_such_witness'" "$work/unknown.json" ||
  { cat "$work/unknown.json"; fail "an unknown witness is not the grader's fault"; }

ls /dev/nvidia0 >/dev/null 2>&1 && { echo "an NVIDIA device is here: witness_test.sh covers the rest"; exit 77; }
"$witness" copy --ceiling "cudaMemcpy D2D" --out "$work/nodevice.json" -- true
grep -q '"fault": "grader"' "$work/nodevice.json" && grep -q "no CUDA device" "$work/nodevice.json" ||
  { cat "$work/nodevice.json"; fail "a machine without a device is not the grader's fault"; }
"$witness" softmax_fast --shapes 3 --out "$work/nodevice_shapes.json" -- true
grep -q '"fault": "grader"' "$work/nodevice_shapes.json" && grep -q "no CUDA device" "$work/nodevice_shapes.json" ||
  { cat "$work/nodevice_shapes.json"; fail "a correctness run without a device is not the grader's fault"; }
echo "PASS: k2c_witness refuses bad arguments and blames itself for what it cannot set up"
