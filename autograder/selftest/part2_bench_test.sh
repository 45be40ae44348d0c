#!/usr/bin/env bash
# part2_bench_test.sh BIN_DIR MPIRUN WORKDIR IMPL — the benchmark programs of modules 11–17 and 19:
# their -h and --help, an unknown flag refused, then each at toy sizes on two CPU ranks (one for
# the decode sweep and the ledger), each to its JSON, and the plot tools
# over that JSON where a Python with matplotlib is at hand. On a GPU machine the same programs make
# the course's figures (tools/gpu-check.sh); here they must start, finish, check their own results
# (the collectives count wrong elements) and write what the plot tools read. Skipped (77) in a
# build from assignments/, whose modules are the student's to finish.
set -uo pipefail
bin=$(cd "$1" && pwd) || exit 1
mpirun=$2
work=$3
[ "${4:-}" = solutions ] || { echo "the benchmarks here are built from ${4:-?}/: checked with the reference's only"; exit 77; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 K2C_BACKEND=mpi
export OMPI_MCA_btl_vader_single_copy_mechanism=none
tools=$(cd "$(dirname "$0")/../../tools" && pwd)
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
fail() { echo "FAIL: $1"; [ -f out.txt ] && tail -n 30 out.txt; exit 1; }

# ranks, program, flags...: runs it under mpirun, which must end with status 0.
bench() {
  local ranks=$1 prog=$2
  shift 2
  "$mpirun" -np "$ranks" --oversubscribe "$bin/$prog" "$@" > out.txt 2>&1 || fail "$prog $* exited $?"
  echo "ok: $prog $*"
}
# file, Python expression over the JSON `j` that must hold.
holds() {
  python3 - "$1" "$2" <<'PY' || fail "$1: $2"
import json, sys
j = json.load(open(sys.argv[1]))
assert eval(sys.argv[2]), j
PY
}

# Every program answers --help with its usage and status 0, and refuses a flag it does not know
# with status 2 (a typo must not run the defaults), before any rank starts work.
for prog in k2c_collectives k2c_data_parallel k2c_zero k2c_tensor_parallel k2c_pipeline_parallel \
            k2c_sequence_parallel k2c_expert_parallel k2c_inference; do
  for help in -h --help; do
    out=$("$bin/$prog" $help 2>/dev/null); rc=$?
    [ $rc = 0 ] && grep -q "^usage:" <<<"$out" || fail "$prog $help exited $rc, printing '$out' on stdout"
  done
  out=$("$mpirun" -np 1 "$bin/$prog" --no-such-flag 1 2>&1 > /dev/null); rc=$?
  [ $rc = 2 ] && grep -q "usage:\|--help lists them" <<<"$out" || fail "$prog --no-such-flag 1 exited $rc, saying '$out'"
  out=$("$mpirun" -np 1 "$bin/$prog" -n many 2>&1 > /dev/null); rc=$?
  [ $rc = 2 ] && grep -q "many" <<<"$out" || fail "$prog -n many exited $rc, saying '$out'"
  echo "ok: $prog -h and --help, an unknown flag and a count that is not a number refused"
done

bench 2 k2c_collectives -b 1K -e 8K -f 8 -n 2 -w 1 -c 1 -o coll.json
holds coll.json "j['ranks'] == 2 and len(j['results']) == 14 and all(r['wrong'] == 0 and r['busbw_gbs'] > 0 for r in j['results'])"
bench 2 k2c_data_parallel --model tiny -b 1K,64K -n 1 -w 1 -o ddp.json --csv ddp.csv
bench 1 k2c_data_parallel --model tiny --ledger --no-step
grep -q "^parameters" out.txt || fail "k2c_data_parallel --ledger printed no ledger"
holds ddp.json "j['ranks'] == 2 and j['parameters'] > 0 and len(j['results']) == 4"
bench 2 k2c_zero --model tiny -w 1 -n 1 -o zero.json
holds zero.json "len(j['rows']) == 5"
bench 2 k2c_tensor_parallel -d 32,64 -t 32 -n 1 -w 1 -o tp.json
holds tp.json "j['ranks'] == 2 and len(j['rows']) == 2"
bench 2 k2c_pipeline_parallel --model cpu -m 2 --rows 1 -w 1 -n 1 -o pipe --no-plot
holds pipe/pipeline_trace.json "j['stages'] == 2 and j['micro_batches'] == 2 and len(j['runs']) == 4"
bench 2 k2c_sequence_parallel -c 8,16 -H 4 -K 2 -d 16 -n 1 -w 1 -o sp.json
holds sp.json "len(j['rows']) == 2"
bench 2 k2c_expert_parallel -t 32,64 -d 32 -k 2 -e 2 -n 1 -w 1 -o ep.json
holds ep.json "len(j['rows']) == 2"
bench 2 k2c_inference -n 3 -r 20 -p 4,8 -o 2,4 -b 2 --model tiny -j serve.json
holds serve.json "'colocated' in j and 'disaggregated' in j and j['kv_bytes_per_request'] > 0"
bench 1 k2c_inference --sweep 1,2 --context 8 --model tiny -j sweep.json
holds sweep.json "len(j['rows']) == 2"

# The plots, where a Python with matplotlib is at hand (the Makefile's bench target looks the same way).
py=python3; $py -c "import matplotlib" 2>/dev/null || { [ -x /usr/bin/python3 ] && py=/usr/bin/python3; }
if ! $py -c "import matplotlib" 2>/dev/null; then
  echo "ok: the benchmarks ran; no Python with matplotlib here, so their plots are not drawn"
  exit 0
fi
plot() {  # the figure it must write, then the tool and its arguments
  local want=$1
  shift
  $py "$tools/$1" "${@:2}" > out.txt 2>&1 || fail "$* exited $?"
  [ -s "$want" ] || fail "$* wrote no $want"
  echo "ok: $1 drew $want"
}
plot ddp.png plot_ddp.py ddp.json --png ddp.png
for f in zero tp sp ep; do plot "$f.png" plot_part2.py "$f.json"; done
plot pipe/timeline.svg plot_pipeline.py pipe/pipeline_trace.json -o pipe/timeline.svg
plot decode.png plot_decode.py sweep.json --png decode.png
echo "ok: every Part II benchmark ran and its plot was drawn"
