#!/usr/bin/env bash
# exports_test.sh BUILD_DIR — an implementation library exports its module's namespace and nothing
# else (docs/SECURITY.md, row 13), so a student file that defines cublasSgemm_v2,
# cudaEventElapsedTime or a harness function cannot interpose it on the program that measures it.
#   1. Every lib/libk2c_impl_NN_name.so of the build exports only k2c::name:: symbols.
#   2. The mechanism, on the real version script of the build's first module (exports/NN_name.map):
#      a library that also defines cudaEventElapsedTime and a harness-looking k2c::testing symbol
#      exports neither when linked with the script, and both without it (so check 1 can fail).
set -euo pipefail
build=$(realpath "$1")
command -v nm >/dev/null && command -v c++filt >/dev/null || { echo "SKIP: nm and c++filt (binutils) are needed"; exit 0; }
exported() { nm -D --defined-only "$1" | awk '{print $NF}' | c++filt; }
status=0
count=0
for lib in "$build"/lib/libk2c_impl_*.so; do
  [ -e "$lib" ] || continue
  id=$(basename "$lib" .so); id=${id#libk2c_impl_}
  name=${id#[0-9][0-9]_}
  while IFS= read -r sym; do
    case "$sym" in
      "k2c::$name::"*) ;;
      *) echo "FAIL: $(basename "$lib") exports '$sym', outside k2c::$name::"; status=1 ;;
    esac
  done < <(exported "$lib")
  count=$((count + 1))
done
[ "$count" -gt 0 ] || { echo "FAIL: no implementation library under $build/lib"; exit 1; }
echo "$count implementation libraries export only their module's namespace"

map=$(ls "$build"/exports/*.map 2>/dev/null | head -n 1)
[ -n "$map" ] || { echo "FAIL: no version script under $build/exports (K2CModule.cmake writes one per module)"; exit 1; }
module=$(basename "$map" .map); module=${module#[0-9][0-9]_}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/interpose.cpp" <<'CPP'
extern "C" int cudaEventElapsedTime(float* ms, void*, void*) { *ms = 1e-3f; return 0; }
namespace k2c::testing { double measured_rate() { return 1e9; } }
namespace k2c::MODULE { int answer() { return 42; } }
CPP
sed -i "s/MODULE/$module/" "$work/interpose.cpp"
c++ -shared -fPIC -o "$work/with_map.so" "$work/interpose.cpp" -Wl,--version-script="$map"
c++ -shared -fPIC -o "$work/without_map.so" "$work/interpose.cpp"
with=$(exported "$work/with_map.so")
without=$(exported "$work/without_map.so")
for sym in cudaEventElapsedTime "k2c::testing::measured_rate()"; do
  if grep -qxF "$sym" <<< "$with"; then echo "FAIL: the version script let '$sym' out"; status=1; fi
  grep -qxF "$sym" <<< "$without" || { echo "FAIL: without the script '$sym' should be exported: the check proves nothing"; status=1; }
done
grep -qxF "k2c::$module::answer()" <<< "$with" || { echo "FAIL: the script hid the module's own namespace"; status=1; }
[ $status = 0 ] && echo "exports OK: interposing symbols stay local to a student's library"
exit $status
