#!/usr/bin/env bash
# tools/gpu-check.sh — everything a kernel change must pass on a GPU machine, in one go:
# build the reference solutions for the local GPU, run the whole test suite, grade the
# solutions (writing the reference-timings file), grade once more under compute-sanitizer,
# measure the ceilings and run the benchmark sweeps.
#
#   OUT=/tmp/k2c-gpu tools/gpu-check.sh [ARCH]      ARCH defaults to 90 (H100 / H200)
#
# K2C_TUNE=0, K2C_CTEST=0, K2C_SANITIZE_RUN=0, K2C_TORCH=0, K2C_TORCH_MOE=0, K2C_PART2=0 leave out those steps (for short follow-up runs);
# K2C_MODULES=06,07 grades those modules only (K2C_SANITIZE_MODULES likewise for the
# compute-sanitizer run, default: the same); K2C_BENCH_FILTER=RE runs only the
# matching benchmarks; K2C_TARGETS="a b" builds only those targets (and the grader);
# K2C_EXPERIMENT=name also builds and runs lab/name.cu (with the arguments in
# K2C_EXPERIMENT_ARGS, e.g. the sections to run); what it prints lands in experiment.txt, and
# figures worth keeping go into lab/results/h200.json.
# Logs and JSON land in $OUT: log.txt (everything, in order), grade.json, reference.json,
# tuned_config.h, sgemm_ladder.png, bandwidth.png, attention.png (with torch_attention.json where
# PyTorch is installed), bench.tar.gz (Google Benchmark JSON per module), decode_sweep.json and
# decode.png (module 19's decode step time against batch size), capstone.tar.gz (module 18's
# reference runs, tools/capstone-runs.sh: K2C_CAPSTONE=0 leaves them out, K2C_CAPSTONE_RUNS="a;b"
# picks entries), and on machines with 2+ GPUs
# collectives.json (module 11's sweep on NCCL; collectives4.json and collectives8.json with 4 and
# 8 GPUs) and part2.tar.gz (modules 12-17's benchmarks on 2 GPUs, plotted). The script prints a short
# summary last.
set -uo pipefail
ARCH=${1:-90}
OUT=${OUT:-/tmp/k2c-gpu}
BUILD=${K2C_GPU_BUILD:-/tmp/k2c-gpu-build}
SEED=${K2C_SEED:-$RANDOM}
mkdir -p "$OUT" /tmp/k2c-bench
export NCCL_NVLS_ENABLE=0
# Debian's PMIx 4.2 crashes in its 'native' node-list encoder inside the gVisor sandbox that some
# GPU machines run in (mpirun dies in pmix_preg_base_generate_ppn); for one node its other
# encoders do the same job.
export PMIX_MCA_preg=${PMIX_MCA_preg:-^native}
LOG="$OUT/log.txt"
: > "$LOG"
step() { echo "=== $* ($(date -u +%H:%M:%S))" | tee -a "$LOG"; }

step "device"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv >> "$LOG" 2>&1
nvcc --version | tail -2 >> "$LOG"

step "configure + build (sm_$ARCH)"
# A tree copied onto a machine (rsync, a device tool) may carry file times older than the outputs
# an earlier build left in $BUILD: the build would then skip what changed. Every source file whose
# content differs from the last build's record is touched first.
mkdir -p "$BUILD"
sums=$(find common autograder solutions assignments lab cmake CMakeLists.txt -type f \
         \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name '*.cpp' -o -name '*.txt' -o -name '*.cmake' -o -name '*.json' \) \
         -print0 | sort -z | xargs -0 md5sum)
if [ -f "$BUILD/k2c-source-sums" ]; then
  diff <(echo "$sums") "$BUILD/k2c-source-sums" | awk '/^</ {print $3}' | xargs -r touch
fi
echo "$sums" > "$BUILD/k2c-source-sums"
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S . -B "$BUILD" "${gen[@]}" -DK2C_IMPL=solutions -DCMAKE_CUDA_ARCHITECTURES="$ARCH" >> "$LOG" 2>&1 ||
  { echo "CONFIGURE FAILED"; tail -40 "$LOG"; exit 1; }
# Keep going past a failing target: the grader then reports that module as not compiling, and
# every other module is still checked.
keep_going=(); [ ${#gen[@]} -gt 0 ] && keep_going=(-- -k 0)
targets=(); [ -n "${K2C_TARGETS:-}" ] && targets=(--target k2c ${K2C_TARGETS})
cmake --build "$BUILD" -j "$(nproc)" "${targets[@]}" "${keep_going[@]}" >> "$LOG" 2>&1 || { echo "BUILD HAD ERRORS:"; grep -E "error" "$LOG" | head -20; }

# Module 05 must run on the tensor cores: HMMA for Part A, HGMMA for Part B, no spills.
lib05="$BUILD/lib/libk2c_impl_05_tensor_core_matmul.so"
if [ -f "$lib05" ]; then
  step "module 05 SASS"
  cuobjdump -sass "$lib05" > /tmp/k2c-sass05.txt 2>&1
  { grep -oE "(HGMMA|HMMA|LDSM|LDGSTS|UTMALDG|UTMASTG|USETMAXREG|LDL|STL)[.A-Z0-9x]*" /tmp/k2c-sass05.txt | sort | uniq -c; } \
    | tee "$OUT/sass05.txt" | tee -a "$LOG"
fi

if [ -n "${K2C_EXPERIMENT:-}" ]; then
  step "experiment $K2C_EXPERIMENT"
  nvcc -O3 -std=c++20 -arch=sm_${ARCH}a -Icommon/include -Iassignments/05_tensor_core_matmul \
    -Iassignments/06_softmax -Iassignments/07_rmsnorm -Iassignments/08_rope -Iassignments/09_flash_attention -Iassignments/10_moe \
    "lab/$K2C_EXPERIMENT.cu" common/src/device.cu common/src/shared_memory.cpp -lcublas -lcuda -o /tmp/k2c-experiment >> "$LOG" 2>&1 &&
    timeout -s KILL 300 /tmp/k2c-experiment ${K2C_EXPERIMENT_ARGS:-} 2>&1 | tee "$OUT/experiment.txt" >> "$LOG"
fi
modules=(); [ -n "${K2C_MODULES:-}" ] && modules=(--modules "$K2C_MODULES")

# Module 04's tile configuration, chosen on this GPU (K2C_TUNE=0 skips): written into the
# solutions tree and kept in $OUT so it can be committed.
if [ "${K2C_TUNE:-1}" = 1 ]; then
  step "tune module 04"
  "$BUILD/bin/k2c_tune_04_register_tiled_matmul" --out solutions/04_register_tiled_matmul/tuned_config.h \
    2>&1 | tee -a "$LOG" | tail -3
  cp solutions/04_register_tiled_matmul/tuned_config.h "$OUT/"
  cmake --build "$BUILD" -j "$(nproc)" >> "$LOG" 2>&1 || { echo "REBUILD FAILED"; exit 1; }
fi

status=0
if [ "${K2C_CTEST:-1}" = 1 ]; then
  step "ctest"
  ctest --test-dir "$BUILD" --output-on-failure >> "$LOG" 2>&1 || status=1
fi

step "grade solutions (seed $SEED)"
"$BUILD/bin/k2c" grade --impl solutions --build-dir "$BUILD" --seed "$SEED" "${modules[@]}" \
  --json "$OUT/grade.json" --write-reference "$OUT/reference.json" > /tmp/k2c-grade.txt 2>> "$LOG"
cat /tmp/k2c-grade.txt >> "$LOG"
# Full marks and no required test failed, or the check fails: the reference solutions must meet
# every goal. Bonus points can make up a module's total for a student, so the total alone would
# hide a missed goal. A required test counts as failed unless it passed or was skipped (a skip
# names its reason: no such hardware here); a bonus test that did not pass (a stretch goal) is
# listed without failing the check.
python3 - "$OUT/grade.json" <<'PY' || status=1
import json, sys
r = json.load(open(sys.argv[1]))
missed = [(m["id"], t["name"], t["status"], t.get("bonus", False)) for m in r["modules"]
          for t in m.get("tests", []) if t["status"] not in ("passed", "skipped")]
for module, test, status, bonus in missed:
    print(f"gpu-check: {module} {test} {status}{' (bonus)' if bonus else ''}")
sys.exit(0 if r["points"] == r["max_points"] and all(bonus for *_, bonus in missed) else 1)
PY

if [ "${K2C_SANITIZE_RUN:-1}" = 1 ]; then
  step "grade solutions under compute-sanitizer"
  sanitize_modules=("${modules[@]}")
  [ -n "${K2C_SANITIZE_MODULES:-}" ] && sanitize_modules=(--modules "$K2C_SANITIZE_MODULES")
  "$BUILD/bin/k2c" grade --impl solutions --build-dir "$BUILD" --seed "$SEED" "${sanitize_modules[@]}" --sanitize \
    --timeout 1200 >> "$LOG" 2>&1
fi

step "ceilings"
"$BUILD/bin/k2c" ceilings >> "$LOG" 2>&1

step "benchmarks"
"$BUILD/bin/k2c" bench --build-dir "$BUILD" --out /tmp/k2c-bench --filter "${K2C_BENCH_FILTER:-.}" >> "$LOG" 2>&1
tar -czf "$OUT/bench.tar.gz" -C /tmp/k2c-bench .

# Module 19: decode throughput against batch size on the GPU backend (K2C_DECODE_SWEEP=0: not).
if [ "${K2C_DECODE_SWEEP:-1}" = 1 ] && [ -x "$BUILD/bin/k2c_inference" ]; then
  step "decode sweep (module 19, NCCL, 1 GPU)"
  "$BUILD/bin/k2c" run -np 1 --backend nccl "$BUILD/bin/k2c_inference" --sweep 1,2,4,8,16,32,64,128,256 \
    --context 1024 -j "$OUT/decode_sweep.json" 2>&1 | tee -a "$LOG" | tail -11
fi

# Module 18: the capstone's reference runs (K2C_CAPSTONE=0: not), by tools/capstone-runs.sh, their
# summaries packed into capstone.tar.gz for tools/merge_reference.py --capstone. K2C_CAPSTONE_RUNS
# names the entries to run, separated by ';' (default: every entry this machine's GPUs can hold).
if [ "${K2C_CAPSTONE:-1}" = 1 ] && [ -x "$BUILD/bin/k2c_capstone" ]; then
  step "capstone reference runs (module 18)"
  entries=()
  [ -n "${K2C_CAPSTONE_RUNS:-}" ] && IFS=';' read -r -a entries <<< "$K2C_CAPSTONE_RUNS"
  OUT=/tmp/k2c-capstone bash tools/capstone-runs.sh "$BUILD" "${entries[@]}" 2>&1 | tee -a "$LOG" | grep -E "^===|median|failed"
  tar -czf "$OUT/capstone.tar.gz" -C /tmp/k2c-capstone .
fi

gpus=$(nvidia-smi -L | wc -l)
if [ "$gpus" -ge 2 ]; then
  step "collectives sweep on 2 GPUs (NCCL)"
  K2C_BACKEND=nccl "$BUILD/bin/k2c" collectives -np 2 --build-dir "$BUILD" -b 1M -e 4G -f 2 -n 20 -w 5 -c 1 \
    -o "$OUT/collectives.json" 2>&1 | tee -a "$LOG" | grep -E "all_reduce" | tail -6
  # Modules 12-17's benchmarks on 2 GPUs, each a JSON in part2.tar.gz (K2C_PART2=0: not); one that
  # fails or runs past 5 minutes is logged and the rest still run.
  if [ "${K2C_PART2:-1}" = 1 ]; then
    mkdir -p "$OUT/part2"
    part2() {  # name, then the program and its flags
      local name=$1
      shift
      step "module $name benchmark on 2 GPUs (NCCL)"
      timeout 300 "$BUILD/bin/k2c" run -np 2 --backend nccl "$@" >> "$LOG" 2>&1 ||
        echo "gpu-check: the $name benchmark failed or timed out (see log.txt)" | tee -a "$LOG"
    }
    part2 12 "$BUILD/bin/k2c_data_parallel" --model perf -o "$OUT/part2/data_parallel.json"
    part2 13 "$BUILD/bin/k2c_zero" --model gpu -o "$OUT/part2/zero.json"
    part2 14 "$BUILD/bin/k2c_tensor_parallel" -o "$OUT/part2/tensor_parallel.json"
    part2 15 "$BUILD/bin/k2c_pipeline_parallel" --model gpu -o "$OUT/part2/pipeline" --no-plot
    part2 16 "$BUILD/bin/k2c_sequence_parallel" -o "$OUT/part2/sequence_parallel.json"
    part2 17 "$BUILD/bin/k2c_expert_parallel" -o "$OUT/part2/expert_parallel.json"
    for f in "$OUT"/part2/{zero,tensor_parallel,sequence_parallel,expert_parallel}.json; do
      [ -f "$f" ] && python3 tools/plot_part2.py "$f" >> "$LOG" 2>&1
    done
    tar -czf "$OUT/part2.tar.gz" -C "$OUT" part2 && rm -rf "$OUT/part2"  # one file to fetch
  fi
fi
for n in 4 8; do
  [ "$gpus" -ge "$n" ] || continue
  step "collectives sweep on $n GPUs (NCCL)"
  K2C_BACKEND=nccl "$BUILD/bin/k2c" collectives -np "$n" --build-dir "$BUILD" -b 1M -e 4G -f 4 -n 20 -w 5 -c 1 \
    -o "$OUT/collectives$n.json" 2>&1 | tee -a "$LOG" | grep -E "all_reduce|wrong" | tail -8
  step "module 11 tests at $n ranks on NCCL"
  "$BUILD/bin/k2c" run -np "$n" --backend nccl "$BUILD/bin/k2c_test_11_collectives" 2>&1 | tee -a "$LOG" | tail -4
done

step "plots"
python3 tools/plot_ladder.py /tmp/k2c-bench --png "$OUT/sgemm_ladder.png" >> "$LOG" 2>&1
python3 tools/plot_bandwidth.py /tmp/k2c-bench --png "$OUT/bandwidth.png" >> "$LOG" 2>&1
# PyTorch's attention backends beside module 09, where PyTorch is installed (it says so if not;
# K2C_TORCH=0 leaves it out).
[ "${K2C_TORCH:-1}" = 1 ] && python3 tools/compare_torch.py --out "$OUT/torch_attention.json" >> "$LOG" 2>&1
# PyTorch's per-expert loop, torch._grouped_mm and a naive layer at module 10's shape (K2C_TORCH_MOE=0: not).
[ "${K2C_TORCH_MOE:-1}" = 1 ] && python3 tools/compare_torch_moe.py --out "$OUT/torch_moe.json" >> "$LOG" 2>&1
python3 tools/plot_moe.py /tmp/k2c-bench --png "$OUT/moe.png" --torch "$OUT/torch_moe.json" >> "$LOG" 2>&1
python3 tools/plot_attention.py /tmp/k2c-bench --png "$OUT/attention.png" --torch "$OUT/torch_attention.json" >> "$LOG" 2>&1
[ -f "$OUT/decode_sweep.json" ] && python3 tools/plot_decode.py "$OUT/decode_sweep.json" --png "$OUT/decode.png" >> "$LOG" 2>&1

step "done"
grep -E "^\[ k2c perf \]" "$LOG" | sort -u
grep -E "compute-sanitizer ERROR SUMMARY" "$LOG"
cat /tmp/k2c-grade.txt
grep -E "tests passed|tests failed" "$LOG"
echo "gpu-check: $([ $status = 0 ] && echo PASS || echo FAIL)"
exit $status
