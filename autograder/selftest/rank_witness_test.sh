#!/usr/bin/env bash
# rank_witness_test.sh K2C_BIN WORKDIR [build|grade] — the grader's own check of a distributed module's
# correctness tests (k2c_rank_witness), on the CPU: module 11 graded twice, as two submissions
# into one build folder.
#   - the reference solution: full marks for its correctness tests, each checked again on three
#     ranks at cases the grader drew;
#   - collectives that never communicate (witness/wrong_collectives.cpp), whose forged report says
#     every correctness test passed: each of them fails on the grader's own check, 0 points.
# The second grading recompiles the submission's file alone: the course's libraries and the
# grader's checker are kept from the first (the stage is rewritten only where bytes differ).
# Skipped (77) without mpirun or without the reference solutions (a handout).
# `build` only builds the first grading's tree (k2c grade --build-only: no rank runs), `grade`
# grades both in it: CTest runs the build beside other tests and holds the MPI lock for the
# gradings alone. With neither, both steps.
set -euo pipefail
k2c=$1
work=$2
step=${3:-all}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
command -v mpirun >/dev/null 2>&1 || { echo "no mpirun: the distributed modules cannot run here"; exit 77; }
[ -f "$root/solutions/11_collectives/collectives.cpp" ] || { echo "no reference solutions here (a handout)"; exit 77; }
tests="AllReduceSum AllReduceMax ReduceScatter AllGather AllReduceInPlace"

if [ "$step" != grade ]; then
  rm -rf "$work"
  mkdir -p "$work/reference/assignments/11_collectives" "$work/forged/assignments/11_collectives"
  cp "$root/solutions/11_collectives/collectives.cpp" "$work/reference/assignments/11_collectives/"
  cp "$here/witness/wrong_collectives.cpp" "$work/forged/assignments/11_collectives/collectives.cpp"
  "$k2c" --root "$root" grade --submission "$work/reference" --modules 11 --build-dir "$work/grading" \
    --build-only > "$work/build.log" 2>&1 || { tail -n 30 "$work/build.log"; echo "FAIL: k2c grade --build-only"; exit 1; }
  echo "built the grading tree in $work/grading"
fi
[ "$step" != build ] || exit 0
[ -d "$work/grading" ] || { echo "FAIL: no grading tree in $work (run the build step first)"; exit 1; }

# test_field REPORT TEST KEY: the value of KEY in TEST's entry of a grader report.
test_field() {
  python3 -c 'import json, sys
r = json.load(open(sys.argv[1]))
t = [t for m in r["modules"] for t in m["tests"] if t["name"] == "Collectives." + sys.argv[2]]
print(t[0].get(sys.argv[3], "") if t else "(no such test)")' "$@"
}

"$k2c" --root "$root" grade --submission "$work/reference" --modules 11 --build-dir "$work/grading" \
  --json "$work/reference.json" > "$work/reference.log" 2>&1 || true
for t in $tests; do
  status=$(test_field "$work/reference.json" "$t" status)
  rechecked=$(test_field "$work/reference.json" "$t" rechecked)
  echo "reference $t: $status, $rechecked"
  [ "$status" = passed ] && [ "$rechecked" = "checked again at 3 shapes the grader drew" ] ||
    { tail -n 30 "$work/reference.log"; echo "FAIL: the reference's $t was not passed and checked again"; exit 1; }
done

# What the first grading built, to compare after the second.
stamp() { stat -c %y "$(find "$work/grading/build" -name "$1" -type f | head -n 1)"; }
core=$(stamp libk2c_core.a); checker=$(stamp k2c_rank_witness); impl=$(stamp 'libk2c_impl_11_collectives.so')
"$k2c" --root "$root" grade --submission "$work/forged" --modules 11 --build-dir "$work/grading" \
  --json "$work/forged.json" > "$work/forged.log" 2>&1 || true
for t in $tests; do
  status=$(test_field "$work/forged.json" "$t" status)
  message=$(test_field "$work/forged.json" "$t" message)
  echo "forged $t: $status: $message"
  [ "$status" = failed ] && [[ "$message" == "the grader's own run at shapes it drew: case "* ]] ||
    { tail -n 30 "$work/forged.log"; echo "FAIL: the forged $t was not failed by the grader's own check"; exit 1; }
done
[ "$(stamp 'libk2c_impl_11_collectives.so')" != "$impl" ] ||
  { echo "FAIL: the second submission's library was not built again"; exit 1; }
# Kept only where code under test ran as another user (a grader run as root): otherwise it could
# have written the build tree, and everything is built again.
runner=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["runner"])' "$work/forged.json")
if [ "$runner" = nobody ]; then
  [ "$(stamp libk2c_core.a)" = "$core" ] && [ "$(stamp k2c_rank_witness)" = "$checker" ] ||
    { echo "FAIL: the second grading built the course's libraries or the checker again"; exit 1; }
  echo "the second grading kept the course's libraries and the checker"
else
  [ "$(stamp libk2c_core.a)" != "$core" ] ||
    { echo "FAIL: code under test ran as $runner, yet the second grading kept the first one's objects"; exit 1; }
  echo "code under test ran as $runner: the second grading built everything again"
fi
points=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["points"])' "$work/forged.json")
[ "$points" = 0 ] || [ "$points" = 0.0 ] || { echo "FAIL: the forgery earned $points points"; exit 1; }
echo "PASS: the reference's collectives are checked again and pass; the forgery's fail on the grader's own check"
