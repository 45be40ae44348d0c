#!/usr/bin/env bash
# check_needed.sh BIN_DIR — the test programs that never call cuBLAS must not load it.
#
# cuBLAS and cuBLASLt are several hundred MB; a program that records them as needed reads them
# all at start, which on a cold disk took longer than test discovery allowed. Programs link with
# --as-needed, and the harness keeps its cuBLAS calls in objects of their own, so only what
# measures or calls cuBLAS loads it. Listed: the programs that must stay free of it.
set -euo pipefail
bin=${1:?usage: check_needed.sh BIN_DIR}
command -v readelf >/dev/null || { echo "readelf not found (binutils): cannot check"; exit 1; }
free_of_cublas=(k2c k2c_selftest k2c_model_test k2c_test_00_roofline k2c_test_06_softmax
                k2c_test_07_rmsnorm k2c_test_08_rope k2c_test_11_collectives)
checked=0 bad=0
for p in "${free_of_cublas[@]}"; do
  [ -x "$bin/$p" ] || continue   # not built here (no CUDA toolkit, no MPI)
  checked=$((checked + 1))
  if readelf -d "$bin/$p" | grep -E 'NEEDED.*libcublas' >/dev/null; then
    echo "FAIL: $p loads cuBLAS but never calls it:"; readelf -d "$bin/$p" | grep NEEDED
    bad=$((bad + 1))
  fi
done
# And the check itself must be able to fail: a program that does call cuBLAS records it.
if [ -x "$bin/k2c_test_05_tensor_core_matmul" ]; then
  readelf -d "$bin/k2c_test_05_tensor_core_matmul" | grep -q 'NEEDED.*libcublas' ||
    { echo "FAIL: k2c_test_05_tensor_core_matmul calls cuBLAS but does not record it"; bad=$((bad + 1)); }
fi
echo "checked $checked programs, $bad problems"
[ "$bad" = 0 ]
