#!/usr/bin/env bash
# rank_witness_kinds_test.sh BUILD_DIR WORKDIR — every check of a distributed correctness test the
# rubric names (rank_witness), run by k2c_rank_witness against the reference solutions' test
# program of its module, as built here: each must pass, so that a check and the contract it reads
# cannot drift apart unnoticed. Skipped (77) without mpirun, or where the build holds another
# tree than the reference solutions (a handout, or a build of assignments/).
set -euo pipefail
build=$1
bin=$build/bin
work=$2
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
command -v mpirun >/dev/null 2>&1 || { echo "no mpirun: the distributed modules cannot run here"; exit 77; }
impl=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("impl", ""))' "$build/k2c_build_info.json" 2>/dev/null || true)
[ "$impl" = solutions ] || { echo "this build holds '$impl', not the reference solutions"; exit 77; }
rm -rf "$work"
mkdir -p "$work"
root_flag=()
[ "$(id -u)" = 0 ] && root_flag=(--allow-run-as-root)
export OMPI_MCA_btl_vader_single_copy_mechanism=none  # as the grader's launches (launch.cpp)
failed=0
while read -r module ranks test kind; do
  "$bin/k2c_rank_witness" "$kind" --out "$work/$kind.json" --ranks "$ranks" --cwd "$work" --timeout 120 -- \
    mpirun -np "$ranks" --oversubscribe "${root_flag[@]}" -x K2C_RANK_WITNESS -x K2C_BACKEND=mpi \
    "$bin/k2c_test_$module" "--k2c_rank_witness=$kind" > "$work/$kind.log" 2>&1 || true
  verdict=$(python3 -c 'import json, sys
try:
    v = json.load(open(sys.argv[1]))
    print(v["fault"] or "ok", v.get("problem", ""), v.get("shapes", ""))
except Exception as e:
    print("no verdict:", e)' "$work/$kind.json")
  echo "$module $test ($kind, $ranks ranks): $verdict"
  case "$verdict" in ok*) ;; *) failed=1; tail -n 20 "$work/$kind.log" ;; esac
done < <(python3 -c 'import json, sys
# The rank count the grader checks a test at (autograder/k2c/grade.cpp): its own
# rank_witness_ranks, else three where the rubric runs three ranks, else its largest MPI run up
# to four.
for m in json.load(open(sys.argv[1]))["modules"]:
    mpi = [r["ranks"] for r in m.get("runs", []) if r.get("backend") == "mpi"]
    ranks = 3 if 3 in mpi else max([r for r in mpi if r <= 4], default=0)
    for t in m["tests"]:
        if "rank_witness" in t:
            print(m["id"], t.get("rank_witness_ranks", ranks), t["name"], t["rank_witness"])' "$root/autograder/rubric.json")
[ "$failed" = 0 ] || { echo "FAIL: a check does not pass against the reference solutions"; exit 1; }
echo "PASS: every check of a distributed correctness test passes against the reference solutions"
