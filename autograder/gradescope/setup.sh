#!/usr/bin/env bash
# Gradescope set-up, run once when the autograder image is built (as root, Ubuntu).
# The runner must have an NVIDIA GPU, its driver and the CUDA toolkit (a self-hosted GPU runner);
# without one the GPU tests are reported as skipped and score 0.
# The course tree is expected at /autograder/source (make_zip.sh puts it there).
set -euo pipefail
cd /autograder/source
export PATH=/usr/local/cuda/bin:$PATH
make deps
cmake -S . -B build/assignments -DK2C_IMPL=assignments
cmake --build build/assignments --target k2c -j "$(nproc)"
