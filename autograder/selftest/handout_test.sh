#!/usr/bin/env bash
# handout_test.sh K2C_BIN WORKDIR — `k2c handout` writes a student tree that builds and grades:
# no solutions/ inside and no solution code anywhere else (tools/leakcheck.py), and its stubs are
# reported as "not implemented yet" (or as skipped when this machine has no CUDA toolkit to build
# GPU modules with).
set -euo pipefail
k2c=$1
work=$2
rm -rf "$work"
"$k2c" handout "$work/handout"
test ! -e "$work/handout/solutions" || { echo "FAIL: solutions/ is in the handout"; exit 1; }
# lab/'s programs compile the solutions into themselves: the handout never has the folder.
test ! -e "$work/handout/lab" || { echo "FAIL: lab/ is in the handout"; exit 1; }
test -f "$work/handout/assignments/01_naive_matmul/naive_matmul.cu" || { echo "FAIL: stub missing"; exit 1; }
test -f "$work/handout/autograder/rubric.json" || { echo "FAIL: rubric missing"; exit 1; }
# The students' README, which never sends them to grade solutions they do not have.
cmp -s "$work/handout/README.md" "$(dirname "$0")/../../docs/README.handout.md" ||
  { echo "FAIL: the handout's README is not docs/README.handout.md"; exit 1; }
if grep -n "IMPL=solutions" "$work/handout/README.md" "$work/handout"/assignments/*/README.md; then
  echo "FAIL: the handout's READMEs mention grading solutions it does not ship"; exit 1
fi
# No solution code elsewhere either: no line copied from solutions/, no file that includes it.
project=$(cd "$(dirname "$0")/../.." && pwd)
command -v python3 >/dev/null || { echo "FAIL: python3 not found, needed for tools/leakcheck.py (make deps)"; exit 1; }
python3 "$project/tools/leakcheck.py" "$project" "$work/handout" > "$work/leakcheck.txt" ||
  { cat "$work/leakcheck.txt"; echo "FAIL: the handout carries solution code"; exit 1; }
tail -n 1 "$work/leakcheck.txt"
# ...and the check does catch both kinds of leak, in a tree made to leak.
mkdir -p "$work/leaky/tools"
cp "$project/solutions/06_softmax/softmax.cu" "$work/leaky/tools/copied.cu"
echo '#include "../../solutions/08_rope/rope.cu"' > "$work/leaky/tools/includes.cu"
if python3 "$project/tools/leakcheck.py" "$project" "$work/leaky" > "$work/leaky.txt"; then
  cat "$work/leaky.txt"; echo "FAIL: leakcheck passed a tree with a solution in it"; exit 1
fi
grep -q "tools/copied.cu:[0-9]*: copies solutions/06_softmax/softmax.cu" "$work/leaky.txt" &&
  grep -q "tools/includes.cu:1: includes" "$work/leaky.txt" ||
  { cat "$work/leaky.txt"; echo "FAIL: leakcheck missed a leak"; exit 1; }

gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$work/handout" -B "$work/build" "${gen[@]}" -DK2C_IMPL=assignments > "$work/configure.log"
if cmake -S "$work/handout" -B "$work/build-solutions" -DK2C_IMPL=solutions > "$work/solutions.log" 2>&1; then
  echo "FAIL: a handout configured with K2C_IMPL=solutions"; exit 1
fi
# CMake wraps long messages over lines: join them before looking.
tr -s ' \n' '  ' < "$work/solutions.log" | grep -q "is not part of this tree" || { echo "FAIL: unclear error for missing solutions"; exit 1; }
cmake --build "$work/build" --target k2c > "$work/build.log"
# The lectures' figures check out in the handout too, those from lab/results/ (not shipped) left
# as written: docs.figures is registered with --without lab where solutions/ is absent.
ctest --test-dir "$work/build" -R '^docs\.figures$' -V > "$work/figures.log" ||
  { cat "$work/figures.log"; echo "FAIL: docs.figures in the handout"; exit 1; }
grep -q "left unchecked" "$work/figures.log" ||
  { cat "$work/figures.log"; echo "FAIL: docs.figures in the handout did not leave lab/'s figures aside"; exit 1; }

# 01 stands for the single-file modules; 05 for those with a bonus part (run as a second
# process) built for sm_90a, here in a second file. (09 and 10, whose bonus part shares their one
# file, take the same paths through the grader; their test programs are the course's slowest to
# compile, so make test leaves them out here.)
"$work/build/bin/k2c" --root "$work/handout" grade --modules 01,05 --build-dir "$work/build" \
  --seed 3 --json "$work/report.json" > "$work/grade.txt" 2>&1
cat "$work/grade.txt"
for id in 01_naive_matmul 05_tensor_core_matmul; do
  # Keys of a module object are written in alphabetical order ("id" before "status").
  status=$(awk -v id="$id" '/"id": /{cur=$0} /"status": /{ if (index(cur, "\"" id "\"")) print }' "$work/report.json" | head -1)
  echo "$id: $status"
  case "$status" in
    *'"not implemented yet"'*|*'"skipped"'*) ;;
    *) echo "FAIL: $id should be 'not implemented yet' in a fresh handout"; exit 1 ;;
  esac
done
echo "handout OK"
