#!/usr/bin/env bash
# deps.sh — `make deps`: check that this machine can build, test and grade the course, and install
# what it lacks.
#
# Each requirement is checked by what it does, not by which package provides it: CMake on PATH at
# version 3.25 or later, a compiler that builds C++20, and the libraries as CMake itself finds them
# (cmake/deps_probe, the root CMakeLists.txt's find_package calls). Tools installed by pip, conda
# or by hand count as present; only what is really missing maps to a Debian package, installed
# with apt-get when running as root. When apt-get cannot install (no network, not root, not
# Debian), the script prints what to install and still succeeds if every required piece is there.
#
# Exit status: 0 when every required piece is present (missing optional ones are only noted),
# 1 otherwise. K2C_DEPS_DRY_RUN=1 checks and prints the apt-get command without running it.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

# python3 runs make test's checks that the student handout holds no solution code
# (tools/leakcheck.py) and that the docs' figures match the reference file (tools/figures.py);
# ninja only speeds builds up; matplotlib only draws make bench's plots.
required=(cmake compiler python3 gtest benchmark cli11 nlohmann_json mpi mpirun)
optional=(ninja matplotlib)
libraries=(gtest benchmark cli11 nlohmann_json mpi mpirun)   # found by cmake/deps_probe

package_of() {  # the Debian package that provides a capability
  case $1 in
    cmake) echo cmake ;;
    compiler) echo g++ ;;
    python3) echo python3 ;;
    gtest) echo libgtest-dev ;;
    benchmark) echo libbenchmark-dev ;;
    cli11) echo libcli11-dev ;;
    nlohmann_json) echo nlohmann-json3-dev ;;
    mpi) echo libopenmpi-dev ;;
    mpirun) echo openmpi-bin ;;
    ninja) echo ninja-build ;;
    matplotlib) echo python3-matplotlib ;;
  esac
}

label_of() {  # what the report calls it
  case $1 in
    compiler) echo "C++20 compiler" ;;
    gtest) echo GoogleTest ;;
    benchmark) echo "Google Benchmark" ;;
    cli11) echo CLI11 ;;
    nlohmann_json) echo nlohmann/json ;;
    mpi) echo "Open MPI" ;;
    *) echo "$1" ;;
  esac
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
declare -A state detail   # capability -> present | missing | unknown, and what was found

mark() { state[$1]=$2; detail[$1]=${3:-}; }

version_at_least() {  # VERSION MINIMUM
  [ "$(printf '%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]
}

check_cmake() {
  local path version
  if ! path=$(command -v cmake); then mark cmake missing "not on PATH"; return; fi
  version=$(cmake --version 2>/dev/null | sed -n '1s/^cmake version \([0-9][0-9.]*\).*/\1/p')
  if [ -z "$version" ]; then
    mark cmake missing "$path does not report a version"
  elif version_at_least "$version" 3.25; then
    mark cmake present "$version at $path"
  else
    mark cmake missing "$version at $path, 3.25 or later needed"
  fi
}

# The compiler CMake would pick: $CXX when set, else the first of c++ and g++ on PATH (CMake's
# own order). It must compile and link what the course uses of C++20: std::span, designated
# initializers, std::string::ends_with.
check_compiler() {
  local candidates=(c++ g++) cxx path
  [ -n "${CXX:-}" ] && candidates=("$CXX")
  cat > "$tmp/cxx20.cpp" <<'EOF'
#include <span>
#include <string>
struct Options { int a = 0; int b = 0; };
int count(std::span<const int> s) { return static_cast<int>(s.size()); }
int main() {
  const Options o{.b = 2};
  const int x[2] = {1, 2};
  return count(x) - o.b + (std::string("k2c.o").ends_with(".o") ? 0 : 1);
}
EOF
  for cxx in "${candidates[@]}"; do
    path=$(command -v "$cxx") || continue
    if "$path" -std=c++20 "$tmp/cxx20.cpp" -o "$tmp/cxx20" >"$tmp/cxx20.log" 2>&1; then
      mark compiler present "$cxx at $path"
    else
      mark compiler missing "$cxx at $path does not compile C++20 (set CXX to one that does)"
    fi
    return
  done
  mark compiler missing "none of ${candidates[*]} on PATH"
}

# The Makefile and the plotting scripts fall back to the system's python3 for matplotlib.
check_python() {
  local py path
  if path=$(command -v python3); then mark python3 present "at $path"; else mark python3 missing "not on PATH"; fi
  for py in python3 /usr/bin/python3; do
    path=$(command -v "$py") || continue
    if "$path" -c "import matplotlib" 2>/dev/null; then mark matplotlib present "for $path"; return; fi
  done
  mark matplotlib missing "make bench writes no plots without it"
}

# Configures cmake/deps_probe in a fresh directory (a cached find result could outlive the
# library it found) and reads its "-- k2c-deps: NAME yes|no" lines.
check_libraries() {
  local lib gen=()
  if [ "${state[cmake]}" != present ] || [ "${state[compiler]}" != present ]; then
    for lib in "${libraries[@]}"; do mark "$lib" unknown "not checked: needs CMake >= 3.25 and a C++20 compiler"; done
    return
  fi
  command -v ninja >/dev/null && gen=(-G Ninja)
  rm -rf "$tmp/probe"
  cmake -S cmake/deps_probe -B "$tmp/probe" "${gen[@]}" > "$tmp/probe.log" 2>&1
  for lib in "${libraries[@]}"; do
    if grep -q "^-- k2c-deps: $lib yes$" "$tmp/probe.log"; then mark "$lib" present "found by CMake"
    elif grep -q "^-- k2c-deps: $lib no$" "$tmp/probe.log"; then mark "$lib" missing
    else mark "$lib" unknown "the CMake probe failed (log below)"
    fi
  done
}

survey() {
  check_cmake
  check_compiler
  check_python
  if command -v ninja >/dev/null; then mark ninja present "at $(command -v ninja)"
  else mark ninja missing "CMake's default generator is used instead"; fi
  check_libraries
}

missing_packages() {  # CAPABILITY... -> " pkg pkg": the packages of those missing, not yet tried
  local cap p
  for cap in "$@"; do
    [ "${state[$cap]}" = missing ] || continue
    p=$(package_of "$cap")
    [[ "$tried " == *" $p "* ]] || printf ' %s' "$p"
  done
}

can_install() {
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null
}

updated=""
apt_install() {  # PACKAGE...
  if [ -z "$updated" ]; then
    # A failed update (no network) leaves the lists already here, which may still serve.
    apt-get update -qq || echo "deps: apt-get update failed (no network?)"
    updated=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# Install only when a required piece is missing (then the optional ones come along): a machine
# that has everything required never calls apt-get, which may have no network to reach. Two
# rounds, because the libraries can only be checked once CMake and a compiler are there.
tried=""
survey
for _ in 1 2; do
  want=$(missing_packages "${required[@]}")
  [ -n "$want" ] || break
  if [ "${K2C_DEPS_DRY_RUN:-0}" != 0 ] || ! can_install; then break; fi
  extra=$(missing_packages "${optional[@]}")
  echo "deps: installing$want$extra"
  read -ra packages <<<"$want"
  apt_install "${packages[@]}" || echo "deps: apt-get could not install$want"
  if [ -n "$extra" ]; then
    read -ra packages <<<"$extra"
    apt_install "${packages[@]}" || echo "deps: apt-get could not install$extra (optional)"
  fi
  tried="$tried$want$extra"
  survey
done

for cap in "${required[@]}" "${optional[@]}"; do
  note=${detail[$cap]}
  [ "${state[$cap]}" = missing ] && note="${note:+$note; }Debian package $(package_of "$cap")"
  [[ " ${optional[*]} " == *" $cap "* ]] && note="$note (optional)"
  printf 'deps: %-8s %-17s %s\n' "${state[$cap]}" "$(label_of "$cap")" "$note"
done

need="" unknown="" optional_missing=""
for cap in "${required[@]}"; do
  case ${state[$cap]} in
    missing) need="$need $(package_of "$cap")" ;;
    unknown) unknown=1 ;;
  esac
done
for cap in "${optional[@]}"; do
  [ "${state[$cap]}" = missing ] && optional_missing="$optional_missing $(package_of "$cap")"
done

if [ -z "$need" ] && [ -z "$unknown" ]; then
  [ -z "$optional_missing" ] || echo "deps: note: optional, not installed:$optional_missing"
  echo "deps: all required present"
  exit 0
fi
if [ -n "$unknown" ] && [ -s "$tmp/probe.log" ]; then
  echo "deps: the CMake probe of the libraries failed:"
  tail -n 20 "$tmp/probe.log" | sed 's/^/      /'
fi
echo "deps: required pieces are missing."
if command -v apt-get >/dev/null; then
  echo "      run: sudo apt-get update && sudo apt-get install -y$need$optional_missing"
else
  echo "      (not a Debian system: install CMake >= 3.25, a C++20 compiler, python3, GoogleTest,"
  echo "       Google Benchmark, CLI11, nlohmann/json and Open MPI with mpirun)"
fi
if [[ "${detail[cmake]}" == *"3.25 or later"* ]]; then
  echo "      (a distribution's cmake may be older than 3.25: 'pip install cmake' gives a newer one)"
fi
[ -z "$unknown" ] || echo "      then run 'make deps' again: the libraries are checked once CMake and a compiler work"
exit 1
