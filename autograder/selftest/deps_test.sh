#!/usr/bin/env bash
# deps_test.sh DEPS_SH WORKDIR — `make deps` (tools/deps.sh) judges a machine by what its tools do,
# not by what the package manager has registered: tools present on PATH are reported present and
# apt-get is never called when nothing required is missing; what is missing is installed or, when
# apt-get fails or may not run, printed, with a failure only for required pieces.
#
# Nothing is ever installed: every case but the last runs on a PATH of fakes (cmake, compilers,
# python3, id, and an apt-get that logs its arguments and fails as it would without network),
# plus the few utilities deps.sh needs, so the machine's own tools stay out of sight. The last
# case runs the real CMake probe, in dry-run mode and with the same failing apt-get in front.
set -euo pipefail
deps=$1
work=$2
bash_bin=$(command -v bash)
mv_bin=$(command -v mv)
rm -rf "$work"
mkdir -p "$work"

fake() {  # DIR NAME BODY: an executable script
  printf '#!%s\n%s\n' "$bash_bin" "$3" > "$1/$2"
  chmod +x "$1/$2"
}

# A bin folder for one case. Fake cmake answers --version with FAKE_CMAKE, and the probe with
# "no" for each library listed in the case's file `missing` (FAKE_MISSING at first), "yes" for the
# others: the lines cmake/deps_probe prints. Tools named in FAKE_ABSENT are left out.
setup() {  # CASE
  local bin=$work/$1/bin t
  mkdir -p "$bin"
  echo "${FAKE_MISSING:-}" > "$work/$1/missing"
  for t in cat dirname grep head mktemp rm sed sort tail; do ln -s "$(command -v "$t")" "$bin/$t"; done
  ln -s "$bash_bin" "$bin/bash"
  fake "$bin" id 'echo "${FAKE_UID:-0}"'
  fake "$bin" apt-get "echo \"\$*\" >> '$work/$1/apt.log'; echo 'E: fake apt-get: no network' >&2; exit 100"
  fake "$bin" cmake '
if [ "$1" = --version ]; then echo "cmake version ${FAKE_CMAKE:-3.28.1}"; exit 0; fi
missing=" $(cat '"$work/$1/missing"') "
for lib in gtest benchmark cli11 nlohmann_json mpi mpirun; do
  if [[ "$missing" == *" $lib "* ]]; then echo "-- k2c-deps: $lib no"; else echo "-- k2c-deps: $lib yes"; fi
done'
  fake "$bin" g++ 'exit 0'
  fake "$bin" c++ 'exit 0'
  fake "$bin" python3 'exit 0'
  fake "$bin" ninja 'exit 0'
  mkdir -p "$work/$1/absent"
  for t in ${FAKE_ABSENT:-}; do mv "$bin/$t" "$work/$1/absent/"; done
}

run_case() {  # CASE [VAR=value...]: runs deps.sh on that case's PATH; sets out and rc
  local name=$1
  shift
  rc=0
  out=$(env -i HOME="$work" PATH="$work/$name/bin" "$@" "$bash_bin" "$deps" 2>&1) || rc=$?
  printf '%s\n' "$out" > "$work/$name/out.txt"
}

fail() { echo "FAIL ($case): $1"; echo "$out"; exit 1; }
expect_rc() { [ "$rc" = "$1" ] || fail "exit status $rc, expected $1"; }
expect() { grep -Eq "$1" <<<"$out" || fail "no line matching '$1'"; }
expect_no_apt() { [ ! -e "$work/$case/apt.log" ] || fail "apt-get was called: $(cat "$work/$case/apt.log")"; }
expect_apt() { grep -q -- "$1" "$work/$case/apt.log" 2>/dev/null || fail "apt-get was not asked for $1"; }

# Everything present, none of it known to a package manager (there is no dpkg on this PATH), as
# root: all reported present, apt-get never called.
case=all_present
setup $case
run_case $case
expect_rc 0
expect '^deps: present +cmake +3\.28\.1 at '
expect '^deps: present +C\+\+20 compiler +c\+\+ at '
for lib in GoogleTest 'Google Benchmark' CLI11 nlohmann/json 'Open MPI' mpirun ninja; do expect "^deps: present +$lib "; done
expect '^deps: all required present'
expect_no_apt
echo "ok ($case)"

# A required library missing, as root, apt-get failing (no network): it was asked for exactly the
# missing packages (the optional ninja too), the command to run is printed, and the exit is 1.
case=no_network
FAKE_ABSENT=ninja FAKE_MISSING=benchmark setup $case
run_case $case
expect_rc 1
expect '^deps: missing +Google Benchmark +Debian package libbenchmark-dev'
expect '^deps: missing +ninja .*\(optional\)'
expect 'sudo apt-get install -y libbenchmark-dev ninja-build'
expect_apt 'install .*libbenchmark-dev'
expect_apt 'install .*ninja-build'
! grep -q 'libgtest-dev\|cmake\|g++' "$work/$case/apt.log" || fail "apt-get was asked for a present piece"
echo "ok ($case)"

# The same with K2C_DEPS_DRY_RUN=1: printed, not run.
case=dry_run
FAKE_ABSENT=ninja FAKE_MISSING=benchmark setup $case
run_case $case K2C_DEPS_DRY_RUN=1
expect_rc 1
expect 'sudo apt-get install -y libbenchmark-dev ninja-build'
expect_no_apt
echo "ok ($case)"

# Not root: printed, not run.
case=not_root
FAKE_MISSING="mpi mpirun" setup $case
run_case $case FAKE_UID=1000
expect_rc 1
expect 'sudo apt-get install -y libopenmpi-dev openmpi-bin'
expect_no_apt
echo "ok ($case)"

# Only an optional piece missing: a note, success, and no apt-get (it may have no network).
case=optional_only
FAKE_ABSENT=ninja setup $case
run_case $case
expect_rc 0
expect '^deps: note: optional, not installed:.*ninja-build'
expect_no_apt
echo "ok ($case)"

# CMake too old (a distribution's 3.22 ahead on PATH): missing, and the libraries cannot be
# checked without it; apt-get is asked for cmake once, and the message says what to do.
case=old_cmake
setup $case
run_case $case FAKE_CMAKE=3.22.1
expect_rc 1
expect '^deps: missing +cmake +3\.22\.1 at .*3\.25 or later needed'
expect '^deps: unknown +GoogleTest'
expect "pip install cmake"
expect "make deps' again"
expect_apt 'install .*cmake'
[ "$(grep -c install "$work/$case/apt.log")" = 1 ] || fail "apt-get install was called more than once"
echo "ok ($case)"

# A fresh machine as root, with a package manager that works: no cmake (so the libraries cannot be
# checked yet), a library and ninja missing. The fake apt-get "installs" by putting the fake tool
# back on PATH or striking the library off `missing`. Round one installs cmake (and ninja), round
# two the library the probe then finds missing; the end state is all present.
case=fresh_machine
FAKE_ABSENT="cmake ninja" FAKE_MISSING=benchmark setup $case
fake "$work/$case/bin" apt-get "
echo \"\$*\" >> '$work/$case/apt.log'
for p in \"\$@\"; do
  case \$p in
    cmake) $mv_bin '$work/$case/absent/cmake' '$work/$case/bin/' ;;
    ninja-build) $mv_bin '$work/$case/absent/ninja' '$work/$case/bin/' ;;
    libbenchmark-dev) echo > '$work/$case/missing' ;;
  esac
done"
run_case $case
expect_rc 0
expect '^deps: installing cmake ninja-build$'
expect '^deps: installing libbenchmark-dev$'
expect '^deps: present +Google Benchmark '
expect '^deps: all required present'
[ "$(grep -c update "$work/$case/apt.log")" = 1 ] || fail "apt-get update was run more than once"
echo "ok ($case)"

# No compiler at all.
case=no_compiler
FAKE_ABSENT="g++ c++" setup $case
run_case $case FAKE_UID=1000
expect_rc 1
expect '^deps: missing +C\+\+20 compiler +none of c\+\+ g\+\+ on PATH'
expect 'sudo apt-get install -y g\+\+'
echo "ok ($case)"

# The real probe on this machine's tools, which built this test: CMake, the compiler, GoogleTest,
# CLI11 and nlohmann/json are all needed to configure the project, so they must be reported
# present (whatever else is missing here). Dry run, with the failing apt-get first on PATH.
case=real_probe
mkdir -p "$work/$case/bin"
fake "$work/$case/bin" apt-get "echo \"\$*\" >> '$work/$case/apt.log'; exit 100"
rc=0
out=$(PATH="$work/$case/bin:$PATH" K2C_DEPS_DRY_RUN=1 "$bash_bin" "$deps" 2>&1) || rc=$?
for what in cmake 'C\+\+20 compiler' GoogleTest CLI11 nlohmann/json; do expect "^deps: present +$what "; done
expect_no_apt
echo "ok ($case, exit $rc)"
echo "deps OK"
