#!/usr/bin/env bash
# check_needed.sh BIN_DIR [CUBLAS] — no program or library of the course records cuBLAS as needed.
#
# cuBLAS and cuBLASLt are several hundred MB, and their initialisers run for about half a second:
# a program that records them as needed pays both at every start, which on a cold disk took
# longer than test discovery allowed, and which every MPI rank of the CPU tests paid for nothing.
# The course's calls go through forwarders that open cuBLAS on their first call
# (common/src/cublas_on_demand.cpp). CUBLAS, the toolkit's library, shows the check can fail.
set -euo pipefail
bin=${1:?usage: check_needed.sh BIN_DIR [CUBLAS]}
cublas=${2:-}
command -v readelf >/dev/null || { echo "readelf not found (binutils): cannot check"; exit 1; }
needs_cublas() { readelf -d "$1" 2>/dev/null | grep -E 'NEEDED.*libcublas' >/dev/null; }
checked=0 bad=0
for p in "$bin"/* "$bin"/../lib/*.so; do
  [ -f "$p" ] || continue
  checked=$((checked + 1))
  if needs_cublas "$p"; then
    echo "FAIL: $(basename "$p") loads cuBLAS at start:"; readelf -d "$p" | grep NEEDED
    bad=$((bad + 1))
  fi
done
if [ -n "$cublas" ]; then
  # The check itself must be able to fail: cuBLAS records cuBLASLt.
  needs_cublas "$cublas" || { echo "FAIL: the check does not see $cublas record cuBLASLt"; bad=$((bad + 1)); }
  # And a program that calls cuBLAS holds the forwarders.
  if [ -x "$bin/k2c_test_05_tensor_core_matmul" ]; then
    syms=$(nm "$bin/k2c_test_05_tensor_core_matmul")
    grep -q ' t cublasCreate_v2$' <<< "$syms" ||
      { echo "FAIL: k2c_test_05_tensor_core_matmul calls cuBLAS without the forwarders"; bad=$((bad + 1)); }
  fi
fi
echo "checked $checked programs and libraries, $bad problems"
[ "$bad" = 0 ]
