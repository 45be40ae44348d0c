#!/usr/bin/env bash
# grade_class_test.sh K2C_BIN WORKDIR — tools/grade_class.py on the fake course: three students
# graded into one build folder (honest work, a module that does not link, nothing handed in),
# what it passes over, scores.csv, and a second run that keeps the reports it already has. Alice's
# honest module also rewrites Carol's file, which arrived writable by all, as unzip can leave an
# upload: Carol, graded after her, must still be graded on what she handed in.
set -euo pipefail
k2c=$(realpath "$1")
work=$(realpath -m "$2")
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
command -v python3 >/dev/null || { echo "FAIL: python3 is needed (make deps)"; exit 1; }
rm -rf "$work"
mkdir -p "$work"
cp -r "$here/fake_course" "$work/course"
mkdir -p "$work/course/common/include/k2c/core"
cp "$root/common/include/k2c/core/todo.h" "$work/course/common/include/k2c/core/"

subs=$work/submissions
honest='#include "fake_gemm.h"
int k2c::gemm::answer() { return 42; }'
mkdir -p "$subs/alice/assignments/90_honest" "$subs/alice/assignments/95_linkerr" "$subs/bob" "$subs/carol" "$subs/bad name"
carol_file="$subs/carol/honest.cpp"
cat > "$subs/alice/assignments/90_honest/honest.cpp" <<EOF
#include <fstream>
#include "fake_gemm.h"
int k2c::gemm::answer() {
  std::ofstream("$carol_file") << "#include \"fake_gemm.h\"\nint k2c::gemm::answer() { return 41; }\n";
  return 42;
}
EOF
printf '#include "fake_gemm.h"\nextern "C" int cublasSgemm_v2(void*, int);\nint k2c::gemm::answer() { return cublasSgemm_v2(nullptr, 42); }\n' \
  > "$subs/alice/assignments/95_linkerr/linkerr.cpp"
echo "$honest" > "$carol_file"                       # flat, as Gradescope uploads
chmod 0777 "$subs/carol" && chmod 0666 "$carol_file"
echo "$honest" > "$subs/bad name/honest.cpp"
echo "not a student" > "$subs/notes.txt"

run() {
  python3 "$root/tools/grade_class.py" "$subs" "$work/out" --k2c "$k2c" --root "$work/course" "$@" \
    -- --rubric "$work/course/submission_rubric.json" --modules 90,95 --seed 1
}
run > "$work/first.log" 2>&1 || { cat "$work/first.log"; echo "FAIL: grade_class.py"; exit 1; }
cat "$work/first.log"
grep -q "^passed over: bad name: a name with characters" "$work/first.log" &&
  grep -q "^passed over: notes.txt: not a folder" "$work/first.log" ||
  { echo "FAIL: what is not a student's folder was not passed over, or not said so"; exit 1; }

python3 - "$work/out/scores.csv" <<'PY'
import csv, sys
rows = {r["student"]: r for r in csv.DictReader(open(sys.argv[1]))}
want = {"alice": ("10", "10", "0"), "bob": ("0", "0", "0"), "carol": ("10", "10", "0")}
fail = []
if sorted(rows) != sorted(want):
    fail.append(f"students {sorted(rows)}, want {sorted(want)}")
for name, (total, m90, m95) in want.items():
    r = rows.get(name, {})
    got = (r.get("points"), r.get("90_honest"), r.get("95_linkerr"))
    if got != (total, m90, m95) or r.get("max_points") != "20":
        fail.append(f"{name}: points, 90, 95 = {got} of {r.get('max_points')}, want {(total, m90, m95)} of 20")
if fail:
    sys.exit("FAIL: scores.csv: " + "; ".join(fail))
print("scores.csv:", ", ".join(f"{n} {rows[n]['points']}" for n in sorted(rows)))
PY
# The plot where matplotlib is, else a line saying why there is none.
if python3 -c "import matplotlib" 2>/dev/null; then
  test -s "$work/out/scores.png" || { echo "FAIL: matplotlib is here, yet no scores.png"; exit 1; }
else
  grep -q "no matplotlib here" "$work/first.log" || { echo "FAIL: no scores.png and no word why"; exit 1; }
fi
for s in alice bob carol; do
  test -s "$work/out/reports/$s.json" && test -s "$work/out/logs/$s.log" || { echo "FAIL: no report or log for $s"; exit 1; }
done
# Carol's 10 points above were earned on her own file: say whether Alice's code reached it.
if grep -q "return 41" "$carol_file"; then
  echo "alice's code rewrote carol's upload; carol was graded on the copy taken before any code ran"
else
  echo "alice's code could not reach carol's upload here (the path is not open to the runner)"
fi

# A second run keeps what the first graded.
run > "$work/second.log" 2>&1 || { cat "$work/second.log"; echo "FAIL: grade_class.py, second run"; exit 1; }
[ "$(grep -c 'kept from an earlier run' "$work/second.log")" = 3 ] ||
  { cat "$work/second.log"; echo "FAIL: the second run graded again what it had"; exit 1; }
# An upload nested 600 folders deep (unzip makes one without trouble) cannot be copied: that
# student is not graded, and says why; the others still are.
deep="$subs/dave/$(python3 -c "print('/'.join(['d'] * 600))")"
mkdir -p "$deep" && echo "$honest" > "$subs/dave/honest.cpp"
if run > "$work/third.log" 2>&1; then cat "$work/third.log"; echo "FAIL: a student not graded, yet status 0"; exit 1; fi
grep -q "dave: not graded: could not copy the upload: folders nested more than 64 deep" "$work/third.log" &&
  [ "$(grep -c 'kept from an earlier run' "$work/third.log")" = 3 ] &&
  grep -q "^dave,,,.*could not copy the upload" "$work/out/scores.csv" ||
  { cat "$work/third.log" "$work/out/scores.csv"; echo "FAIL: the deep upload stopped the class, or was not reported"; exit 1; }
# A kept report that lacks what scores.csv reads is graded again, not read.
rm -rf "$subs/dave"
echo '{"points": 5}' > "$work/out/reports/bob.json"
run > "$work/fourth.log" 2>&1 || { cat "$work/fourth.log"; echo "FAIL: grade_class.py, fourth run"; exit 1; }
[ "$(grep -c 'kept from an earlier run' "$work/fourth.log")" = 2 ] && grep -q "bob: .* points (" "$work/fourth.log" ||
  { cat "$work/fourth.log"; echo "FAIL: a report without modules was kept"; exit 1; }
# Arguments k2c refuses stop the class at the first student; a --k2c that is not there, at once.
if python3 "$root/tools/grade_class.py" "$subs" "$work/out2" --k2c "$k2c" --root "$work/course" -- --modules 77 \
     > "$work/fifth.log" 2>&1; then cat "$work/fifth.log"; echo "FAIL: k2c refused its arguments, yet status 0"; exit 1; fi
grep -q "k2c refused its arguments" "$work/fifth.log" && [ "$(grep -c 'not graded' "$work/fifth.log")" = 0 ] ||
  { cat "$work/fifth.log"; echo "FAIL: a usage error went on to the next student"; exit 1; }
if python3 "$root/tools/grade_class.py" "$subs" "$work/out3" --k2c "$work/no-k2c" > "$work/sixth.log" 2>&1 ||
   ! grep -q "no such program" "$work/sixth.log"; then cat "$work/sixth.log"; echo "FAIL: a missing --k2c"; exit 1; fi
echo "PASS: three students graded into one build folder, the others passed over, the reports kept, a deep upload refused, a report without modules graded again, a usage error and a missing k2c stopping the class"
