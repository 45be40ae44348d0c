#!/usr/bin/env bash
# capstone_cli_test.sh PROGRAM MPIRUN WORKDIR IMPL — k2c_capstone's command line on two CPU ranks:
# --help; unknown and bad flags, configs, grids and data folders refused with exit 2 and the reason; a dp2 run that writes its progress lines, CSV log,
# JSON summary (kernels table, one step timed operation by operation) and checkpoint; a resumed run
# that continues the same log from the checkpoint's step. Skipped (77) in a build from assignments/,
# whose capstone is the student's to finish.
set -uo pipefail
prog=$1
mpirun=$2
work=$3
[ "${4:-}" = solutions ] || { echo "k2c_capstone here is built from ${4:-?}/: checked with the reference's only"; exit 77; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 K2C_BACKEND=mpi
export OMPI_MCA_btl_vader_single_copy_mechanism=none
rm -rf "$work" && mkdir -p "$work"
fail() { echo "FAIL: $1"; [ -f "$work/out.txt" ] && tail -n 30 "$work/out.txt"; exit 1; }

refused() {  # expected message, flags...
  local want=$1 out rc
  shift
  out=$("$prog" "$@" 2>&1); rc=$?
  [ $rc = 2 ] || fail "'$*' exited $rc, not 2"
  grep -qF -- "$want" <<<"$out" || fail "'$*' said '$out', not '$want'"
  echo "ok: '$*' refused: $out"
}
out=$("$prog" --help 2>&1); rc=$?
[ $rc = 0 ] && grep -qF -- "--grid dp2,tp2,pp2" <<<"$out" || fail "'--help' exited $rc: $out"
echo "ok: '--help' prints the command lines"
refused "unknown argument '--no-such-flag' (k2c_capstone --help lists them)" --no-such-flag
refused "--kernels fast: course or trusted" --kernels fast
refused "--resume needs --checkpoint FILE" --resume
refused "--steps: 'many' is not a number" --steps many
refused "--config huge: one of tiny, tiny-moe, dense-135m, moe-135m" --config huge
refused "'xy' is not an axis" --grid xy2
refused "'dp' is given twice" --grid dp2,dp4
refused "it ends with a separator" --grid tp2x
refused "'dp' needs a size from 1 to 99999" --grid dp99999999999
refused "--data $work/none: not a folder" --data "$work/none"
refused "--steps: a whole number from 1 to 1000000000" --steps 0
refused "--steps: a whole number from 1 to 1000000000" --steps 1e10
refused "--steps: a whole number from 1 to 1000000000" --steps 2.7
refused "--lr: a number above 0" --lr -1
refused "--seed: a whole number from 0" --seed -1
refused "--resume: cannot read the checkpoint $work/none.bin" --resume --checkpoint "$work/none.bin"
refused "--json $work/none/run.json: cannot write there" --json "$work/none/run.json"
refused "--bucket-mib: from 1/1024 (1 KiB) to 4096" --bucket-mib 0
refused "plan: tp 3 must divide the heads" --plan --grid tp3
# --plan: one process, any grid, no training; the tables of grid_plan.h.
out=$("$prog" --plan --grid dp2,tp2,pp2 --batch 8 --micro-batches 2 2>&1); rc=$?
[ $rc = 0 ] || fail "'--plan' exited $rc: $out"
for want in "grid dp2,tp2,pp2 on 8 ranks" "memory of one rank" "  1      1-1" "tp       2      all_reduce" \
            "pp       2      send"; do
  grep -qF -- "$want" <<<"$out" || fail "'--plan' did not print '$want': $out"
done
grep -q "^step" <<<"$out" && fail "'--plan' trained: $out"
echo "ok: --plan prints the stages' state and traffic without training"
out=$("$prog" --plan-ranks 4 --config tiny-moe 2>&1); rc=$?
[ $rc = 0 ] || fail "'--plan-ranks 4' exited $rc: $out"
for want in "grids of 4 ranks" "  dp4 " "  dp2,tp2 " "  ep4 " "  tp2,pp2 " "bubble"; do
  grep -qF -- "$want" <<<"$out" || fail "'--plan-ranks 4' did not list '$want': $out"
done
grep -qF "  tp4 " <<<"$out" && fail "'--plan-ranks 4' listed tp4, which 2 kv heads cannot take: $out"
refused "--plan-ranks: a whole number from 1 to 65536" --plan-ranks 0
"$prog" --plan-ranks 4 --config tiny-moe --json "$work/grids.json" > /dev/null 2>&1 || fail "'--plan-ranks --json' exited $?"
python3 - "$work/grids.json" <<'PY' || fail "the plan's JSON"
import json, sys
p = json.load(open(sys.argv[1]))
assert len(p["grids"]) == 8 and p["batch"] == 8, p
for g in p["grids"]:
    assert g["ranks"] == 4 and g["memory_bytes"] > 0 and g["wire_bytes"]["all"] > 0, g
    assert len(g["stages"]) == int(g["grid"].split("pp")[1][0]) if "pp" in g["grid"] else len(g["stages"]) == 1, g
PY
# The figure, where a Python with matplotlib is at hand (the Makefile's bench target looks the same way).
py=python3; $py -c "import matplotlib" 2>/dev/null || { [ -x /usr/bin/python3 ] && py=/usr/bin/python3; }
if $py -c "import matplotlib" 2>/dev/null; then
  $py "$(dirname "$0")/../../tools/plot_grids.py" "$work/grids.json" --memory-gib 1 --png "$work/grids.png" > /dev/null \
    && [ -s "$work/grids.png" ] || fail "tools/plot_grids.py did not draw the plan"
fi
echo "ok: --plan-ranks lists the grids that fit"
# A grid that the ranks cannot hold is found on every rank: status 2, the reason said once.
out=$(timeout 120 "$mpirun" -np 2 --oversubscribe "$prog" --grid dp3 --samples 0 2>&1); rc=$?
[ $rc = 2 ] || fail "'--grid dp3' on 2 ranks exited $rc, not 2: $out"
[ "$(grep -c "grid dp3 has 3 ranks, the world 2" <<<"$out")" = 1 ] || fail "'--grid dp3' on 2 ranks did not say why once: $out"
echo "ok: '--grid dp3' on 2 ranks refused once, status 2"

run() { timeout 240 "$mpirun" -np 2 --oversubscribe "$prog" --grid dp2 --batch 4 --samples 0 "$@" > "$work/out.txt" 2>&1; }
run --steps 4 --time-ops --traffic --bucket-mib 0.125 --json "$work/run.json" --log "$work/run.csv" --checkpoint "$work/ckpt" || fail "the dp2 run exited $?"
for line in "kernels: trusted (the CPU backend" "step     4/4" "where one more step's time went" "linear backward (dW, dX)" \
            "traffic of rank 0 in the last step, beside the plan"; do
  grep -qF "$line" "$work/out.txt" || fail "no '$line' in the output"
done
python3 - "$work/run.json" <<'PY' || fail "the JSON summary"
import json, sys
r = json.load(open(sys.argv[1]))
assert r["grid"] == "dp2" and r["ranks"] == 2 and r["bucket_bytes"] == 131072, (r["grid"], r["ranks"], r["bucket_bytes"])
assert len(r["steps"]) == 4 and [s["step"] for s in r["steps"]] == [0, 1, 2, 3], r["steps"]
assert r["kernels"] == {}, r["kernels"]  # no course kernels on the CPU backend
assert r["ops_ms"].get("matmul fwd (a bT)", 0) > 0 and r["ops_ms"].get("attention backward", 0) > 0, r["ops_ms"]
# The host's part of each operation: the same operations, each within its whole.
assert r["ops_host_ms"].keys() == r["ops_ms"].keys(), (r["ops_host_ms"], r["ops_ms"])
assert r["ops_in_step_ms"] == {}, r["ops_in_step_ms"]  # the CPU backend has no queue to mark
assert all(0 <= r["ops_host_ms"][k] <= r["ops_ms"][k] for k in r["ops_ms"]), (r["ops_host_ms"], r["ops_ms"])
assert r["median_tokens_per_s"] > 0
# --traffic: the last step's gradients all-reduced over dp, as planned (the tiny model's 123,712
# weights in fp32), and the loss and norm over the world.
assert r["traffic_sent"] == r["traffic_planned"] == {"dp all_reduce": 4 * 123712, "world all_reduce": 16}, r
print("ok: the JSON summary:", len(r["steps"]), "steps,", len(r["ops_ms"]), "operations timed, traffic as planned")
PY
[ "$(wc -l < "$work/run.csv")" = 5 ] || fail "the log has $(wc -l < "$work/run.csv") lines, not a header and 4 steps"

run --steps 6 --log "$work/run.csv" --checkpoint "$work/ckpt" --resume || fail "the resumed run exited $?"
grep -qF "resumed from $work/ckpt at step 4" "$work/out.txt" || fail "no 'resumed from ... at step 4'"
[ "$(wc -l < "$work/run.csv")" = 7 ] || fail "the resumed log has $(wc -l < "$work/run.csv") lines, not 7"
[ "$(tail -n 1 "$work/run.csv" | cut -d, -f1)" = 5 ] || fail "the log's last step is not 5"
echo "ok: resumed at step 4, the log continued to step 5"
