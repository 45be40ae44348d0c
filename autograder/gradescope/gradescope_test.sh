#!/usr/bin/env bash
# gradescope_test.sh K2C_BIN WORKDIR [bundle|grade] — the Gradescope bundle, run the way Gradescope runs it.
# make_zip.sh builds the zip with K2C_BIN; it is extracted into WORKDIR/autograder/source beside
# submission/ and results/ (Gradescope's layout, under a root other than /autograder); setup.sh
# runs there, then run_autograder grades a sample submission: module 11 implemented (the
# reference solution, uploaded flat), module 01 handed in as its stub, module 00 absent (its stub
# is then graded), and a stray file. The rubric is cut to modules 00, 01 and 11 to keep the test
# quick (a Part II module would build the model library twice more). results.json must follow Gradescope's format and
# give, test by test, the scores that `k2c grade --submission` gives the same files from a copy
# of this checkout, graded in the same build folder without building the course again. Then the
# grader's own check of module 11's correctness tests (k2c_rank_witness): the reference's were
# each checked again on three ranks, and a forged submission whose collectives never communicate
# fails every one of them and earns 0. A third submission reaches through the view it is given to
# the library's own collectives: it fails every correctness test too. And the direct grading runs
# with a plain file planted where Open MPI would make the runner's session directory, as an
# earlier submission could leave it: each run's TMPDIR is its own folder, so module 11 still runs.
# CPU only, to stay quick: both trees are configured with -DK2C_CUDA=OFF, so the GPU modules are
# reported as skipped, as they are on a grading machine without a GPU.
# `bundle` makes the zip and runs setup.sh (which builds; no rank runs), `grade` the rest: CTest
# runs the first beside other tests and holds the MPI lock for the second alone. With neither,
# both.
set -euo pipefail
k2c=$(realpath "$1")
work=$(realpath -m "$2")
step=${3:-all}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
command -v python3 >/dev/null || { echo "FAIL: python3 is needed to read the zip and the JSON (make deps)"; exit 1; }
ag=$work/autograder
t0=$SECONDS
lap() { echo "-- $1 ($((SECONDS - t0)) s)"; }
# The course's rubric, cut to three modules that stand for the kinds (00 and 01 GPU, 11 MPI):
# every module graded means every module built, twice, and the flow is the same for all. 11 keeps
# its runs at 1 and 3 ranks (and NCCL's, skipped here): the grader checks its tests again at 3,
# and its runs at 2, 4 and 8 ranks (module 11's own tests run them) would only slow all three
# gradings down.
trim_rubric() {
  python3 - "$1" <<'PY'
import json, sys
keep = {"00_roofline", "01_naive_matmul", "11_collectives"}
rubric = json.load(open(sys.argv[1]))
rubric["modules"] = [m for m in rubric["modules"] if m["id"] in keep]
for m in rubric["modules"]:
    if "runs" in m:
        m["runs"] = [r for r in m["runs"] if r["backend"] != "mpi" or r["ranks"] in (1, 3)]
json.dump(rubric, open(sys.argv[1], "w"), indent=2)
PY
}

if [ "$step" != grade ]; then
rm -rf "$work"
mkdir -p "$work/bin"

# ---- the bundle: the two scripts and the course at the root of the zip, no solutions
"$here/make_zip.sh" "$work/autograder.zip" "$k2c"
python3 - "$work/autograder.zip" <<'PY'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
names = set(z.namelist())
for need in ("setup.sh", "run_autograder", "Makefile", "CMakeLists.txt", "autograder/rubric.json",
             "assignments/11_collectives/collectives.cpp"):
    if need not in names:
        sys.exit(f"FAIL: {need} is not at its place in the zip")
for bad in ("source/", "solutions/", "build/"):
    if any(n.startswith(bad) for n in names):
        sys.exit(f"FAIL: the zip holds {bad}")
if not (z.getinfo("run_autograder").external_attr >> 16) & 0o100:
    sys.exit("FAIL: run_autograder is not executable in the zip")
PY
lap "zip laid out as Gradescope's specification asks"

# ---- Gradescope's layout: the whole zip extracted into source/ (keeping the Unix modes, as
# unzip does), the student's files in submission/, an empty results/
mkdir -p "$ag/source" "$ag/submission" "$ag/results"
python3 - "$work/autograder.zip" "$ag/source" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for info in z.infolist():
        path = z.extract(info, sys.argv[2])
        mode = (info.external_attr >> 16) & 0o777
        if mode:
            os.chmod(path, mode)
PY
trim_rubric "$ag/source/autograder/rubric.json"
cp "$repo/solutions/11_collectives/collectives.cpp" "$ag/submission/"
mkdir -p "$ag/submission/assignments/01_naive_matmul"
cp "$repo/assignments/01_naive_matmul/naive_matmul.cu" "$ag/submission/assignments/01_naive_matmul/"
echo "not part of any module" > "$ag/submission/notes.txt"

# ---- setup.sh, as at image build. `make deps` must find everything present (make test ran it
# first); should it want to install anyway, this apt-get stands in and installs nothing.
printf '#!/bin/sh\necho "gradescope_test: apt-get $*: not run (the test installs nothing)"\n' > "$work/bin/apt-get"
chmod +x "$work/bin/apt-get"
if ! (cd / && PATH="$work/bin:$PATH" AUTOGRADER_ROOT="$ag" K2C_CMAKE_ARGS="-DK2C_CUDA=OFF" \
        bash "$ag/source/setup.sh") > "$work/setup.log" 2>&1; then
  tail -n 40 "$work/setup.log"; echo "FAIL: setup.sh"; exit 1
fi
grep '^deps:' "$work/setup.log" || true
lap "setup.sh built the grader in the extracted bundle"
# setup.sh built what grading builds: a submission recompiles its own files, not the course.
core=$(find "$ag/grading/build/common" -name 'libk2c_core.a' | head -n 1)
[ -n "$core" ] || { tail -n 40 "$work/setup.log"; echo "FAIL: setup.sh built nothing in $ag/grading/build"; exit 1; }
echo "$core" > "$work/core"
stat -c %y "$core" > "$work/core_built"
fi
[ "$step" != bundle ] || exit 0
[ -s "$work/core" ] || { echo "FAIL: no bundle set up in $work (run the bundle step first)"; exit 1; }
core=$(cat "$work/core")
core_built=$(cat "$work/core_built")

# ---- run_autograder, as per submission: Gradescope copies it to the root and runs it from there
cp -p "$ag/source/run_autograder" "$ag/run_autograder"
if ! (cd "$ag" && AUTOGRADER_ROOT="$ag" ./run_autograder) > "$ag/results/stdout" 2>&1; then
  tail -n 40 "$ag/results/stdout"; echo "FAIL: run_autograder"; exit 1
fi
grep '^submission:' "$ag/results/stdout" || { echo "FAIL: run_autograder took no submission"; exit 1; }
lap "run_autograder graded the sample submission"

# setup.sh's configuration must be the one the submission was built with: the grader keeps a
# build tree's cache only while it points at the staged folder setup.sh prepared.
grep -q '^K2C_CUDA:BOOL=OFF' "$ag/grading/build/CMakeCache.txt" ||
  { echo "FAIL: the grader's build tree lost setup.sh's K2C_CMAKE_ARGS"; exit 1; }
# Objects are kept only where code under test ran as another user (as root: nobody); where it
# ran as the grader's own user, everything is built again (docs/SECURITY.md, row 23).
report_field() { python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"; }
runner=$(report_field "$ag/results/k2c_report.json" runner)
if [ "$runner" = nobody ]; then
  [ "$(stat -c %y "$core")" = "$core_built" ] ||
    { echo "FAIL: run_autograder built the course's own libraries again ($core)"; exit 1; }
else
  echo "code under test ran as $runner: the submission was built from scratch"
fi

# ---- the same files graded directly by the k2c under test, from a copy of this checkout (the
# grader stops when its course tree changes under it, and others may be editing this one), in
# the build folder run_autograder used: the grader stages the copy's files over the bundle's, and
# rebuilds whatever differs between them
direct=$(mktemp -d)
# What code under test as nobody could leave in /tmp for the next submission: a plain file named as
# Open MPI's session directory of that account, which stops every mpirun that makes it there.
plant=""
if [ "$(id -u)" = 0 ] && id nobody > /dev/null 2>&1; then
  plant="${TMPDIR:-/tmp}/ompi.$(hostname).$(id -u nobody)"
  if [ -e "$plant" ]; then plant=""; else touch "$plant" && chown nobody "$plant"; fi
fi
trap 'rm -rf "$direct"; [ -z "$plant" ] || rm -f "$plant"' EXIT
# Open to others, as the bundle's tree is: code under test then runs as nobody here too, and the
# grader keeps run_autograder's objects (it builds everything again where it must run as root).
chmod 755 "$direct"
"$k2c" --root "$repo" handout "$direct/course" > /dev/null
trim_rubric "$direct/course/autograder/rubric.json"
if ! OMPI_MCA_btl_vader_single_copy_mechanism=none "$k2c" --root "$direct/course" grade \
       --impl assignments --build-dir "$ag/grading" --submission "$ag/submission" \
       --json "$work/direct.json" > "$work/direct.log" 2>&1; then
  tail -n 40 "$work/direct.log"; echo "FAIL: k2c grade --submission"; exit 1
fi
grep -q '^K2C_CUDA:BOOL=OFF' "$ag/grading/build/CMakeCache.txt" ||
  { echo "FAIL: k2c grade did not keep the CPU-only cache of $ag/grading/build"; exit 1; }
lap "k2c grade graded the same files${plant:+ (with $plant planted)}"
# Module 11's MPI runs (ranks and the grader's rank witness) had a network of their own, loopback
# alone, wherever root here may make one and set its loopback up (CAP_NET_ADMIN, bit 12): a
# grading that fell back to the machine's network would pass the same, so it is asked for here.
net_admin=$(( 0x$(awk '/^CapEff/ {print $2}' /proc/self/status) >> 12 & 1 ))
if [ "$(report_field "$work/direct.json" runner)" = nobody ] && [ "$net_admin" = 1 ] && unshare -n true 2> /dev/null; then
  network=$(report_field "$work/direct.json" network)
  [ "$network" = "each run's own (loopback alone)" ] || { echo "FAIL: the runs' network: $network"; exit 1; }
  echo "module 11's runs had a network of their own"
fi

# ---- results.json: Gradescope's format, the direct grade's scores, GPU modules skipped
python3 - "$ag/results/results.json" "$work/direct.json" "$repo/autograder/rubric.json" <<'PY'
import json, sys
gs = json.load(open(sys.argv[1]))
direct = json.load(open(sys.argv[2]))
kind = {m["id"]: m.get("kind", "gpu") for m in json.load(open(sys.argv[3]))["modules"]}
fail = []
num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)

# The format: https://gradescope-autograders.readthedocs.io/en/latest/specs/
if not num(gs.get("score")): fail.append("score is not a number")
if not isinstance(gs.get("output"), str) or "total" not in gs["output"]: fail.append("output lacks the table")
tests = gs.get("tests")
if not isinstance(tests, list) or not tests: fail.append("no tests")
for t in tests or []:
    if not (isinstance(t.get("name"), str) and num(t.get("score")) and num(t.get("max_score"))
            and isinstance(t.get("output"), str)):
        fail.append(f"malformed test entry {t}")
    if t.get("status", "passed") not in ("passed", "failed"): fail.append(f"bad status in {t}")

# The scores k2c gave the same files: one entry per test, or one per module whose verdict
# replaces its tests (skipped for want of CUDA, build failed, crashed, ...).
module_level = {"crashed", "timed out", "no report", "incomplete", "invalid", "build failed", "refused"}
want = []
for m in direct["modules"]:
    if m["status"] in module_level or not m["tests"]:
        want.append((f'{m["id"]}: {m["status"]}', m["points"], m["max_points"]))
    else:
        for t in m["tests"]:
            want.append((f'{m["id"]} / {t["name"]}' + (" (bonus)" if t["bonus"] else ""),
                         t["points"], 0 if t["bonus"] else t["max_points"]))
got = [(t["name"], t["score"], t["max_score"]) for t in tests or []]
if got != want:
    fail.append("per-test scores differ from k2c grade's:\n  results.json: %s\n  k2c grade:    %s" % (got, want))
if abs(gs.get("score", -1) - direct["points"]) > 1e-9:
    fail.append(f'score {gs.get("score")} != k2c grade total {direct["points"]}')
if abs(sum(t["score"] for t in tests or []) - gs.get("score", -1)) > 1e-9:
    fail.append("the tests' scores do not add up to score")

# What this sample must show: module 11 graded on CPU (its NCCL-only perf test skipped), the
# other MPI modules (absent: their stubs graded) "not implemented yet", every GPU module skipped
# with the reason, module 01's stub taken but never built.
by_id = {m["id"]: m for m in direct["modules"]}
m11 = by_id["11_collectives"]
if not any(t["status"] == "passed" for t in m11["tests"]) or m11["points"] <= 0:
    fail.append(f'11_collectives was not graded: {m11["status"]} {m11["detail"]}')
for t in m11["tests"]:
    if "Perf" not in t["name"] and t["status"] != "passed":
        fail.append(f'11_collectives / {t["name"]}: {t["status"]}')
for m in direct["modules"]:
    if m["id"] == "11_collectives": continue
    if kind.get(m["id"]) == "mpi":
        if m["status"] != "not implemented yet":
            fail.append(f'{m["id"]}: its stub graded "{m["status"]}" ({m["detail"]}), not "not implemented yet"')
        continue
    entry = [t for t in tests or [] if t["name"] == f'{m["id"]}: skipped']
    if not entry or "CUDA" not in entry[0]["output"]:
        fail.append(f'{m["id"]} is not shown as skipped for want of CUDA')

if fail:
    print("FAIL:\n" + "\n".join(fail))
    sys.exit(1)
# The results.json of this run, its table shortened, for the record.
gs["output"] = gs["output"][:600] + ("..." if len(gs["output"]) > 600 else "")
print(json.dumps(gs, indent=2))
print(f'results.json agrees with k2c grade: {len(got)} entries, score {gs["score"]} of '
      f'{sum(t["max_score"] for t in tests)}')
PY
grep -q "notes.txt: ignored" "$ag/results/stdout" || { echo "FAIL: the stray file was not reported"; exit 1; }
lap "results.json agrees"

# ---- the grader's own check of module 11's correctness tests (k2c_rank_witness), in the same
# tree. The reference's tests passed above; each must also have been checked again on three ranks
# at cases the grader drew. Then collectives that never communicate (witness/wrong_collectives.cpp),
# whose forged report says every correctness test passed, graded as the next submission: each of
# those tests fails on the grader's own check, 0 points, and only the submission's library is
# built again (kept objects: code under test ran as nobody; where it ran as root, all rebuilt).
tests="AllReduceSum AllReduceMax ReduceScatter AllGather AllReduceInPlace"
test_field() {  # REPORT TEST KEY: KEY of Collectives.TEST in a grader report
  python3 -c 'import json, sys
r = json.load(open(sys.argv[1]))
t = [t for m in r["modules"] for t in m["tests"] if t["name"] == "Collectives." + sys.argv[2]]
print(t[0].get(sys.argv[3], "") if t else "(no such test)")' "$@"
}
for t in $tests; do
  rechecked=$(test_field "$work/direct.json" "$t" rechecked)
  [ "$rechecked" = "checked again at 3 shapes the grader drew" ] ||
    { echo "FAIL: the reference's $t was not checked again by the grader ($rechecked)"; exit 1; }
done
stamp() { stat -c %y "$(find "$ag/grading/build" -name "$1" -type f | head -n 1)"; }
checker=$(stamp k2c_rank_witness); impl=$(stamp 'libk2c_impl_11_collectives.so')
mkdir -p "$work/forged/assignments/11_collectives"
cp "$repo/autograder/selftest/witness/wrong_collectives.cpp" "$work/forged/assignments/11_collectives/collectives.cpp"
# Graded with --sanitize, which must not switch the grader's own checks off (it once did, and
# every forged pass stood).
OMPI_MCA_btl_vader_single_copy_mechanism=none "$k2c" --root "$direct/course" grade --impl assignments \
  --build-dir "$ag/grading" --submission "$work/forged" --modules 11 --sanitize --json "$work/forged.json" \
  > "$work/forged.log" 2>&1 || true
for t in $tests; do
  status=$(test_field "$work/forged.json" "$t" status)
  message=$(test_field "$work/forged.json" "$t" message)
  echo "forged $t: $status: $message"
  [ "$status" = failed ] && [[ "$message" == "the grader's own run at shapes it drew: case "* ]] ||
    { tail -n 30 "$work/forged.log"; echo "FAIL: the forged $t was not failed by the grader's own check"; exit 1; }
done
points=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["points"])' "$work/forged.json")
[ "$points" = 0 ] || [ "$points" = 0.0 ] || { echo "FAIL: the forgery earned $points points"; exit 1; }
[ "$(stamp 'libk2c_impl_11_collectives.so')" != "$impl" ] ||
  { echo "FAIL: the forged submission's library was not built"; exit 1; }
runner=$(report_field "$work/forged.json" runner)
if [ "$runner" = nobody ]; then
  [ "$(stat -c %y "$core")" = "$core_built" ] && [ "$(stamp k2c_rank_witness)" = "$checker" ] ||
    { echo "FAIL: grading the forgery built the course's libraries or the checker again"; exit 1; }
fi
lap "the grader's own check failed the forged collectives (code under test ran as $runner)"

# ---- collectives borrowed from the library through the view's Communicator: right answers, no
# ring; every correctness test fails on the count of library collectives, 0 points
mkdir -p "$work/unwrapping/assignments/11_collectives"
cp "$repo/autograder/selftest/witness/unwrapping_collectives.cpp" "$work/unwrapping/assignments/11_collectives/collectives.cpp"
OMPI_MCA_btl_vader_single_copy_mechanism=none "$k2c" --root "$direct/course" grade --impl assignments \
  --build-dir "$ag/grading" --submission "$work/unwrapping" --modules 11 --json "$work/unwrapping.json" \
  > "$work/unwrapping.log" 2>&1 || true
for t in $tests; do
  status=$(test_field "$work/unwrapping.json" "$t" status)
  message=$(test_field "$work/unwrapping.json" "$t" message)
  echo "unwrapping $t: $status: ${message:0:160}"
  [ "$status" = failed ] && [[ "$message" == *"started a collective of the communication library"* ]] ||
    { tail -n 30 "$work/unwrapping.log"; echo "FAIL: the unwrapping $t was not failed for its library collective"; exit 1; }
done
points=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["points"])' "$work/unwrapping.json")
[ "$points" = 0 ] || [ "$points" = 0.0 ] || { echo "FAIL: the unwrapping submission earned $points points"; exit 1; }
lap "collectives borrowed through the view failed every correctness test"
