#!/usr/bin/env bash
# merge_reference_test.sh PYTHON MERGE REFERENCE WORKDIR — tools/merge_reference.py on a copy of
# the reference file: a graded run replaces the modules it measured and leaves the rest; --capstone
# puts a k2c_capstone summary into the capstone section under its name, dated, and leaves the other
# entries; a bad NAME=FILE pair, a file that is not a summary (or not a JSON object, or with
# figures of the wrong types) and a run of another GPU are refused with a message, the file untouched.
set -euo pipefail
py=$1
merge=$2
reference=$3
work=$4
rm -rf "$work"
mkdir -p "$work"
ref="$work/ref.json"
cp "$reference" "$ref"
fail() { echo "FAIL: $*"; exit 1; }

# A capstone summary, as k2c_capstone --json --time-ops writes one (the fields the entry keeps).
cat > "$work/run.json" <<'JSON'
{"grid": "1", "ranks": 1, "model": "tiny", "micro_batches": 1, "zero_stage": 0, "activations": "bf16",
 "ops_ms": {"adamw": 1.5}, "steps": 10, "median_tokens_per_s": 12345, "model_tflops_per_rank": 1.0,
 "cublas_bf16_tflops": 800.0, "ratio": 0.00125, "peak_memory_bytes_rank0": 1024}
JSON
"$py" "$merge" --capstone "selftest entry=$work/run.json" --into "$ref" > "$work/out.txt" || fail "merge refused a summary"
"$py" - "$ref" "$reference" <<'PY' || fail "the capstone entry is not what the summary says"
import json, sys
ref, old = (json.load(open(p)) for p in sys.argv[1:3])
e = ref["capstone"]["selftest entry"]
assert e["median_tokens_per_s"] == 12345 and e["ratio"] == 0.00125 and e["ops_ms"] == {"adamw": 1.5}, e
assert "date" in e and "steps" not in e and "zero_stage" not in e, e
assert all(ref["capstone"][k] == v for k, v in old["capstone"].items()), "another entry changed"
assert ref["modules"] == old["modules"], "the modules changed"
PY

# Refusals: the file stays as it was.
cp "$ref" "$work/before.json"
echo "not json" > "$work/bad.json"
echo '{"grid": "1"}' > "$work/partial.json"
echo '5' > "$work/number.json"
echo '{"grid": "1", "model": "m", "median_tokens_per_s": "fast", "ratio": null, "ops_ms": {}}' > "$work/typed.json"
echo '{"gpu": "x", "date": "d", "seed": 1, "modules": []}' > "$work/listed.json"
for args in "--capstone noequals" "--capstone =$work/run.json" "--capstone x=$work/bad.json" \
            "--capstone x=$work/partial.json" "--capstone x=$work/missing.json" "--capstone x=$work/number.json" \
            "--capstone x=$work/typed.json" "$work/number.json" "$work/listed.json"; do
  # shellcheck disable=SC2086  # the arguments are words
  if "$py" "$merge" $args --into "$ref" > "$work/out.txt" 2>&1; then fail "merge took $args"; fi
  grep -q "merge_reference:" "$work/out.txt" || fail "no message for $args: $(cat "$work/out.txt")"
  cmp -s "$ref" "$work/before.json" || fail "$args changed the file"
done

# A graded run: its module replaced, the others kept; one of another GPU refused.
"$py" - "$ref" "$work/graded.json" "$work/other_gpu.json" <<'PY'
import json, sys
ref = json.load(open(sys.argv[1]))
module = sorted(ref["modules"])[0]
tests = {name: dict(t, achieved=-1.0) for name, t in ref["modules"][module].items()}
run = {"gpu": ref["gpu"], "date": "2000-01-01", "seed": 7, "modules": {module: tests}, "ceilings": {}}
json.dump(run, open(sys.argv[2], "w"))
json.dump(dict(run, gpu="some other GPU"), open(sys.argv[3], "w"))
PY
"$py" "$merge" "$work/graded.json" --into "$ref" > "$work/out.txt" || fail "merge refused a graded run"
"$py" - "$ref" "$work/before.json" <<'PY' || fail "the graded run's module was not merged as it should be"
import json, sys
ref, old = (json.load(open(p)) for p in sys.argv[1:3])
module = sorted(old["modules"])[0]
assert all(t["achieved"] == -1.0 for t in ref["modules"][module].values())
assert ref["module_dates"][module] == "2000-01-01" and ref["module_seeds"][module] == 7
assert all(ref["modules"][m] == old["modules"][m] for m in old["modules"] if m != module), "another module changed"
PY
cp "$ref" "$work/before.json"
if "$py" "$merge" "$work/other_gpu.json" --into "$ref" > "$work/out.txt" 2>&1; then fail "merge took another GPU's run"; fi
cmp -s "$ref" "$work/before.json" || fail "another GPU's run changed the file"
echo "merge_reference: all cases pass"
