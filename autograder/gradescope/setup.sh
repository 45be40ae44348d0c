#!/usr/bin/env bash
# Gradescope set-up, run once when the autograder image is built (as root, Ubuntu). Gradescope
# extracts the bundle into $AUTOGRADER_ROOT/source, so this script sits beside the course's
# Makefile there. Builds the grader, and configures once the tree every submission is built in.
#
#   AUTOGRADER_ROOT  Gradescope's root (default /autograder); the self-test uses a temporary one
#   K2C_CMAKE_ARGS   extra CMake arguments for both trees, split on spaces (default none): the
#                    self-test passes -DK2C_CUDA=OFF, a GPU image may pin -DCMAKE_CUDA_ARCHITECTURES=90
#
# GPU modules need the CUDA toolkit in the image (nvcc on PATH or in /usr/local/cuda/bin) and a
# GPU on the machine that grades (a self-hosted GPU runner); without either, their tests are
# reported as skipped and score 0. The MPI module grades on CPU anywhere.
set -euo pipefail
root=${AUTOGRADER_ROOT:-/autograder}
cd "$root/source"
export PATH=/usr/local/cuda/bin:$PATH
read -r -a cmake_args <<< "${K2C_CMAKE_ARGS:-}"
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)

make deps
cmake -S . -B build/assignments "${gen[@]}" -DK2C_IMPL=assignments "${cmake_args[@]}"
cmake --build build/assignments --target k2c -j "$(nproc)"

# Submissions are graded with --build-dir $root/grading (run_autograder), outside the course tree,
# where `k2c grade --submission` stages each one in grading/staged and builds it in grading/build.
# The grader configures that tree with -DK2C_IMPL only, and keeps a cache that points at the same
# staged folder: stage and configure it here, once, with the generator and K2C_CMAKE_ARGS, and
# every submission is built with them (and skips the CUDA detection).
rm -rf "$root/grading"
build/assignments/bin/k2c --root . handout "$root/grading/staged" > /dev/null
cmake -S "$root/grading/staged" -B "$root/grading/build" "${gen[@]}" -DK2C_IMPL=assignments \
  "${cmake_args[@]}"
# Then build there, once, all that a grading builds (the grader's checkers, each module's test
# program on the stubs), by grading an empty submission with --build-only: the grader rewrites
# only the staged files whose bytes differ, so a submission recompiles its own files, not the
# course.
empty=$(mktemp -d)
build/assignments/bin/k2c --root . grade --impl assignments --build-dir "$root/grading" --submission "$empty" \
  --build-only
rmdir "$empty"
echo "setup.sh: grader built in build/assignments; submissions build in $root/grading/build (prebuilt)"
