#!/usr/bin/env bash
# tools/capstone-runs.sh — the capstone's reference runs on one GPU (two for the dp2 runs), each a k2c_capstone summary
# named after the entry of autograder/reference/<gpu>.json it is for:
#
#   OUT=/tmp/capstone tools/capstone-runs.sh BUILD [ENTRY ...]
#
# BUILD is a build of the reference solutions (cmake -DK2C_IMPL=solutions) with k2c and
# k2c_capstone built. ENTRY names runs from the list below (by default all of them that this
# machine's GPUs can hold: the dp2 runs need two). Each run trains under `k2c run -np RANKS
# --backend nccl` on the Markov data (16 sequences of 1024 tokens a rank; dense 10 steps, MoE 30) with
# --time-ops, and writes $OUT/<entry>.json (spaces as _) and its log beside it; the line to merge
# them all is printed last:
#
#   python3 tools/merge_reference.py --capstone "dense-135m course bf16=$OUT/dense-135m_course_bf16.json" ...
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: OUT=DIR tools/capstone-runs.sh BUILD [ENTRY ...]" >&2; exit 2; }
BUILD=$1
shift
OUT=${OUT:-/tmp/k2c-capstone}
export NCCL_NVLS_ENABLE=0
for bin in k2c k2c_capstone; do
  [ -x "$BUILD/bin/$bin" ] || { echo "capstone-runs: no $BUILD/bin/$bin (build the reference solutions first)" >&2; exit 2; }
done
mkdir -p "$OUT"

# entry name → the run's flags.
declare -A FLAGS=(
  ["dense-135m f32 same day"]="--config dense-135m --steps 10 --kernels trusted --activations f32"
  ["dense-135m bf16"]="--config dense-135m --steps 10 --kernels trusted --activations bf16"
  ["dense-135m course f32 same day"]="--config dense-135m --steps 10 --kernels course --activations f32"
  ["dense-135m course bf16"]="--config dense-135m --steps 10 --kernels course --activations bf16"
  # The residual stream in bf16 too (--residual bf16), trusted and course kernels.
  ["dense-135m bf16 residual"]="--config dense-135m --steps 10 --kernels trusted --activations bf16 --residual bf16"
  ["dense-135m course bf16 residual"]="--config dense-135m --steps 10 --kernels course --activations bf16 --residual bf16"
  ["moe-135m"]="--config moe-135m --steps 30 --kernels trusted --activations f32"
  ["moe-135m course"]="--config moe-135m --steps 30 --kernels course --activations f32"
  ["moe-135m bf16"]="--config moe-135m --steps 30 --kernels trusted --activations bf16"
  ["moe-135m course bf16"]="--config moe-135m --steps 30 --kernels course --activations bf16"
  # Data parallel over two GPUs, each rank the one-GPU run's 16 sequences (--batch is the global
  # batch): tokens/s over the grid-1 entry of the same mode is data parallelism's scaling. With
  # --traffic, NCCL's last step is counted beside the plan (traffic_sent, traffic_planned).
  ["dense-135m course bf16 dp2"]="--grid dp2 --batch 32 --config dense-135m --steps 10 --kernels course --activations bf16 --traffic"
  ["moe-135m course bf16 dp2"]="--grid dp2 --batch 32 --config moe-135m --steps 30 --kernels course --activations bf16 --traffic"
)
ORDER=("dense-135m f32 same day" "dense-135m bf16" "dense-135m course f32 same day" "dense-135m course bf16"
       "dense-135m bf16 residual" "dense-135m course bf16 residual"
       "moe-135m" "moe-135m course" "moe-135m bf16" "moe-135m course bf16")
# The GPUs this process can use: CUDA_VISIBLE_DEVICES's list where it is set, else nvidia-smi's.
if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
  gpus=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .)
else
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
fi
if [ $# -gt 0 ]; then
  ORDER=("$@")
elif [ "$gpus" -ge 2 ]; then
  ORDER+=("dense-135m course bf16 dp2" "moe-135m course bf16 dp2")
else
  echo "capstone-runs: $gpus GPU(s) here: the dp2 runs (two GPUs) are left out"
fi

merge=()
status=0
for entry in "${ORDER[@]}"; do
  flags=${FLAGS[$entry]:-}
  [ -n "$flags" ] || { echo "capstone-runs: no run named '$entry' (known: ${!FLAGS[*]})" >&2; exit 2; }
  ranks=1
  [[ $flags == *"--grid dp2"* ]] && ranks=2
  [[ $flags == *"--batch "* ]] || flags+=" --batch 16"
  if [ "$ranks" -gt 1 ] && [ "$ranks" -gt "$gpus" ]; then
    echo "capstone-runs: '$entry' needs $ranks GPUs, this machine has $gpus" >&2
    status=1
    continue
  fi
  file="$OUT/${entry// /_}"
  echo "=== $entry ($(date -u +%H:%M:%S))"
  # shellcheck disable=SC2086  # the flags are words
  if "$BUILD/bin/k2c" run -np "$ranks" --backend nccl "$BUILD/bin/k2c_capstone" $flags --samples 0 --time-ops \
       --json "$file.json" > "$file.log" 2>&1; then
    grep -E "^median" "$file.log"
    merge+=("\"$entry=$file.json\"")
  else
    echo "capstone-runs: '$entry' failed; the end of its log ($file.log):" >&2
    tail -15 "$file.log" >&2
    status=1
  fi
done
[ ${#merge[@]} -gt 0 ] && echo "to merge: python3 tools/merge_reference.py --capstone ${merge[*]}"
exit $status
