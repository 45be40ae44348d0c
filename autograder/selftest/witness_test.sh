#!/usr/bin/env bash
# witness_test.sh K2C_BIN WORKDIR [REFERENCE_BUILD] — the grader's own run of a timed kernel (k2c_witness), on a
# machine with an NVIDIA GPU (elsewhere: skipped, exit 77). Module 06 graded four ways:
#   - the reference solution: full marks, its figure witnessed and consistent with the report, its
#     fast softmax checked again at shapes the grader drew;
#   - the reference made to crawl (each call spins the GPU for a millisecond first), its report
#     forged to claim 95% of the copy rate: void, the report's figure is far above what the
#     grader's own run saw;
#   - a wrong softmax whose forged report says every test passed: void, the grader's own run
#     checked the output itself;
#   - the reference at the timed width only (nothing at any other), its report forged to say
#     every test passed at the speed this GPU measured: the figure stands, and the fast softmax's correctness
#     test fails on the grader's own check at shapes it drew;
#   - the reference as it is, its report's ceiling (the copy rate) forged to 0.85 of what was
#     measured, which lifts the ratio by 18% (still below the rubric's limit of what is
#     possible, 1.25): the grader measured the ceiling itself, and takes the ratio against its own.
set -euo pipefail
k2c=$1
work=$2
reference_build=${3:-$work/reference}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
ls /dev/nvidia0 >/dev/null 2>&1 || { echo "no NVIDIA device: the witness needs a GPU"; exit 77; }
[ -f "$root/solutions/06_softmax/softmax.cu" ] || { echo "no reference solutions here (a handout)"; exit 77; }
rm -rf "$work"
mkdir -p "$work"

field() {  # field FILE KEY: the first "KEY": "value" of the JSON report
  grep -o "\"$2\": \"[^\"]*\"" "$1" | head -n 1 | sed 's/^[^:]*: "//; s/"$//'
}

"$k2c" --root "$root" grade --impl solutions --modules 06 --build-dir "$reference_build" \
  --json "$work/reference.json" > "$work/reference.log" 2>&1 || true
status=$(field "$work/reference.json" status)
[ "$status" = ok ] || { cat "$work/reference.log"; echo "FAIL: the reference solution graded '$status'"; exit 1; }
grep -q '"witnessed": [0-9]' "$work/reference.json" ||
  { grep -n witness "$work/reference.json"; echo "FAIL: the reference's figure was not witnessed"; exit 1; }
grep -o '"achieved": [0-9.e+]*\|"witnessed": [0-9.e+]*' "$work/reference.json"
grep -q '"rechecked": "checked again at 3 shapes the grader drew"' "$work/reference.json" ||
  { grep -n rechecked "$work/reference.json"; echo "FAIL: the reference's fast softmax was not checked again"; exit 1; }

for case in slow wrong tail ceiling; do
  sub="$work/$case/submission"
  mkdir -p "$sub/assignments/06_softmax"
  if [ "$case" = ceiling ]; then
    { echo "#define K2C_FORGER_HONEST_SPEED 1"; echo "#define K2C_FORGER_CEILING_SCALE 0.85"
      cat "$here/witness/forger.inc" "$root/solutions/06_softmax/softmax.cu"; } > "$sub/assignments/06_softmax/softmax.cu"
  elif [ "$case" != wrong ]; then
    # The tail forgery lies about correctness only: its report keeps the speed this GPU measured.
    { [ "$case" = tail ] && echo "#define K2C_FORGER_HONEST_SPEED 1"
      cat "$here/witness/forger.inc"; grep -v '#include "dispatch.h"' "$root/solutions/06_softmax/softmax.cu"
      cat "$here/witness/${case}_end.cu"; } > "$sub/assignments/06_softmax/softmax.cu"
  else
    cat "$here/witness/forger.inc" "$here/witness/wrong_softmax.cu" > "$sub/assignments/06_softmax/softmax.cu"
  fi
  "$k2c" --root "$root" grade --submission "$sub" --modules 06 --build-dir "$work/submissions" \
    --json "$work/$case.json" > "$work/$case.log" 2>&1 || true
  status=$(field "$work/$case.json" status)
  detail=$(field "$work/$case.json" detail)
  echo "$case: $status: $detail"
  want=invalid
  [ "$case" = tail ] && want=partial
  [ "$case" = ceiling ] && want=ok
  [ "$status" = "$want" ] || { tail -n 30 "$work/$case.log"; echo "FAIL: the $case forgery graded '$status'"; exit 1; }
done
grep -q "the report says 3800 GB/s, the grader's own run of the same kernel reached at most" "$work/slow.json" ||
  { echo "FAIL: the slow forgery was voided for another reason"; exit 1; }
grep -q "the grader's own run of the timed kernel failed: window 1, launch 1 of" "$work/wrong.json" ||
  { echo "FAIL: the wrong forgery was voided for another reason"; exit 1; }
grep -q "the grader's own run at shapes it drew: at shape" "$work/tail.json" ||
  { echo "FAIL: the tail forgery's correctness test did not fail on the grader's own check"; exit 1; }
grep -q "taken against the grader's own measurement of cudaMemcpy D2D, [0-9.e+]* GB/s (the report's: " "$work/ceiling.json" ||
  { grep -n "message" "$work/ceiling.json"; echo "FAIL: the ceiling forgery's ratio was not taken against the grader's ceiling"; exit 1; }
# ...which gives back the honest ratio (about 1 of the copy rate), not the forged 1.18.
python3 - "$work/ceiling.json" <<'PY' || { echo "FAIL: the ceiling forgery kept its inflated ratio"; exit 1; }
import json, sys
r = json.load(open(sys.argv[1]))
t = next(t for m in r["modules"] for t in m["tests"] if t["name"] == "SoftmaxPerf.FastVsCopy")
print("ceiling forgery: ratio", round(t["perf"]["ratio"], 3), "against", round(t["perf"]["ceiling"]), "GB/s")
sys.exit(0 if t["perf"]["ratio"] < 1.1 else 1)
PY
# The reference's honest ceiling was measured by the grader too, and let stand.
grep -q '"witnessed_ceiling": [0-9]' "$work/reference.json" ||
  { grep -n ceiling "$work/reference.json"; echo "FAIL: the grader did not measure the reference's ceiling"; exit 1; }
grep -o '"ceiling": [0-9.e+]*\|"witnessed_ceiling": [0-9.e+]*' "$work/reference.json"
echo "PASS: the witness voids the forgeries of rate and output, undoes the lowered ceiling, fails the unwritten shapes, and agrees with the reference"
