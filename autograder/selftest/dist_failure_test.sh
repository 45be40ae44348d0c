#!/usr/bin/env bash
# dist_failure_test.sh PROGRAM MPIRUN — a rank that throws, or one that hangs, ends the whole
# job with a clear message within the time limit (no hang, no silent success), and so does an
# exchange started without a wait, when synchronize() completes it.
set -uo pipefail
prog=$1
mpirun=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 K2C_BACKEND=mpi K2C_DIST_TIMEOUT=3
export OMPI_MCA_btl_vader_single_copy_mechanism=none
check() {  # mode, expected message
  local start=$SECONDS out rc
  out=$(timeout 60 "$mpirun" -np 2 --oversubscribe "$prog" "$1" 2>&1); rc=$?
  local took=$((SECONDS - start))
  if [ $rc = 0 ]; then echo "FAIL ($1): the job exited 0"; echo "$out"; exit 1; fi
  if [ $rc = 124 ]; then echo "FAIL ($1): the job hung (killed after 60 s)"; exit 1; fi
  if ! grep -q "$2" <<<"$out"; then echo "FAIL ($1): no '$2' in the output:"; echo "$out"; exit 1; fi
  echo "ok ($1): exit $rc after ${took} s: $(grep -m1 "$2" <<<"$out")"
}
check throw "rank 1: planted failure in the middle of a ring"
check hang "rank 0: send_recv did not complete within 3 s"
check hang_open "rank 0: send_recv did not complete within 3 s"
