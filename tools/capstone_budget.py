#!/usr/bin/env python3
"""The ceiling of the capstone's course mode on one GPU: what a dense-135M step would take if only
its GEMMs, its attention calls and AdamW cost anything, each at the time it was measured alone.

    python3 tools/capstone_budget.py [--write | --check] [--lab FILE] [--reference FILE]

Reads the measurements it adds up, all from one GPU's files:
  lab/results/h200.json        capstone_gemms (each product of the step timed alone; weighted
                               here by its calls, on the kernels course mode runs it on: module 05
                               for the forward and input-gradient products, module 10's weight
                               gradient split into groups of tokens), and
                               attention/experiment/capstone_shape (module 09's Part B forward and
                               backward calls at the capstone's shape; SHIPPED names the run of
                               the shipped build)
  autograder/reference/h200.json
                               capstone/dense-135m course bf16 (its model: layers and sequence
                               length; AdamW's time, the model FLOPs a token, the run's tokens/s,
                               ratio and cuBLAS bf16 rate) and ceilings/cudaMemcpy D2D (the copy
                               rate, for comparison), with inference/decode_pages/read_only_gbs
                               from the lab file (a read-only pass: the memory-bound operations'
                               floor is taken at that rate)
and prints the budget: the sum, the tokens/s and ratio to cuBLAS it would give, and what the rest
of the measured step costs; the least the memory-bound operations (norms, RoPE, SwiGLU, adds,
cross-entropy, embedding) can take as passes of their own at the fastest stream measured, with the
ratio the kernels plus those passes would give (the ceiling of any design that leaves them
unfused), for an fp32 and a bf16 residual stream; where the run has ops_in_step_ms, that rest by
part (the memory-bound operations by group, and what the products, attention and AdamW took in
the step beyond their times alone); where it has ops_host_ms, also the CPU's time to issue the
step's work and its share of the measured step. --write records it as capstone_budget in the lab
file, where the docs read it from (tools/figures.py); --check exits 1 where the recorded budget is
not the one its measurements give now (a reference run or lab result replaced without --write after it). --lab
and --reference point at another GPU's files (default: the H200's), --attention-run at the run of
capstone_shape to take (default: the shipped build's).
"""
import argparse
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAB = ROOT / "lab/results/h200.json"
REFERENCE = ROOT / "autograder/reference/h200.json"
RUN = "dense-135m course bf16"
# Each product of capstone_gemms: its calls per layer (per step for the head) and, for each of its
# three forms, the rate course mode gets (autograder/18_capstone/course_kernels.cu).
PRODUCTS = {"q, k, v, o": 4, "gate, up": 2, "down": 1}
FORMS = {"forward": "05_tflops", "dW": "10_split_tflops", "dx": "05_tflops"}
SHIPPED = "run3"  # capstone_shape's run of the shipped build of module 09 on the H200
# Operations that hand a result back to the host, so wait for the GPU inside the call: their host
# time is their whole time, not the cost of issuing them (k2c/model/timed_ops.h).
READ_BACK = {"cross-entropy", "sum_squares", "upload", "download", "column_sums", "route_rows"}
COPY = "cudaMemcpy D2D"  # the reference's copy ceiling: bytes read + written a second, device to device
GOAL = 0.62  # the module's goal: model FLOP rate over cuBLAS bf16 (README's course map, lecture 18 section 3)
# The rest of the step by part, on the run's in-step clock (ops_in_step_ms): the memory-bound
# operations in these groups, every other such operation as "other operations", and what the
# budget's own operations took in the step beyond their times alone.
PRODUCT_OPS = ("matmul fwd (a bT)", "linear backward (dW, dX)")
ATTENTION_OPS = ("attention", "attention backward")
BETWEEN = "(between operations)"
REST_GROUPS = {"rmsnorm": ("rmsnorm", "rmsnorm backward"), "rope": ("rope",), "swiglu": ("swiglu", "swiglu backward"),
               "add": ("add",), "cross-entropy": ("cross-entropy",)}


def gemm_step(gemms, layers):
    """The step's products on course mode's kernels, each at its rate alone: (ms, TFLOP)."""
    ms = tflop = 0.0
    for name, calls in list(PRODUCTS.items()) + [("head", None)]:
        for form, rate in FORMS.items():
            p = gemms[f"{name} {form}"]
            flop = (calls * layers if calls else 1) * 2.0 * p["M"] * p["N"] * p["K"]
            ms += flop / (p[rate] * 1e12) * 1e3
            tflop += flop * 1e-12
    return ms, tflop


def dense_shape(run):
    """(d, layers, heads, kv heads, ff, vocab, T) from a dense run's model line."""
    m = re.search(r"d (\d+), (\d+) layers, (\d+) heads \((\d+) kv\), ff (\d+), vocab (\d+), T (\d+)", run["model"])
    if not m:
        raise SystemExit(f"capstone_budget: cannot read the dense model's shape from {run['model']!r}")
    return tuple(int(g) for g in m.groups())


def memory_floor(run, tokens, stream_bytes):
    """The bytes (GB) by part that the step's memory-bound operations move, each one pass reading
    and writing its operands once, for a residual stream of stream_bytes a value. Activations are
    bf16 (the run's --activations bf16); what the products, attention and AdamW move is in their
    own times."""
    d, layers, heads, kv, ff, vocab, _ = dense_shape(run)
    A, R = 2, stream_bytes  # bytes of an activation and of a value of the residual stream
    nd, nkv, nff = tokens * d, tokens * d // heads * kv, tokens * ff
    per_layer = {
        # two norms: forward reads the stream and writes bf16; backward reads x, dy and the residual's
        # gradient and writes the stream's gradient (one pass with the add).
        "rmsnorm": 2 * ((R + A) * nd + (3 * R + A) * nd),
        # q and k rotated in place, forward and backward.
        "rope": 2 * 2 * A * (nd + nkv),
        # forward reads gate and up, writes h; backward reads gate, up, dh, writes dgate and dup.
        "swiglu": 3 * A * nff + 5 * A * nff,
        # x + branch: the stream and a bf16 branch read, the stream written; twice a layer.
        "add": 2 * (2 * R + A) * nd,
    }
    parts = {k: v * layers for k, v in per_layer.items()}
    parts["rmsnorm"] += (R + A) * nd + (2 * R + A) * nd  # the final norm (no residual gradient to add)
    parts["cross-entropy"] = 2 * A * tokens * vocab         # logits read, their gradient written
    parts["embedding"] = 2 * R * nd  # its output written, its gradient read (table rows repeat: L2 may hold them)
    return {k: v / 1e9 for k, v in parts.items()}


def budget_of(lab, reference, run, attention_run):
    """The budget (a dict for lab results) from the measurements; KeyError where one is missing."""
    # The step's shape: layers and sequence length from the run's model, tokens from the products.
    _, layers, _, _, _, _, seq = dense_shape(run)
    tokens = lab["capstone_gemms"]["q, k, v, o forward"]["M"]
    if tokens % seq:
        raise SystemExit(f"capstone_budget: {tokens} tokens are not whole sequences of {seq}")

    products_ms, products_tflop = gemm_step(lab["capstone_gemms"], layers)
    shipped = lab["attention"]["experiment"]["capstone_shape"][attention_run]
    forward = shipped["forward: Part B forward (shipped at d = 64)"]["ms"]
    backward = shipped["backward: Part B (shipped)"]["ms"]
    attention_ms = layers * (forward + backward)
    adamw_ms = run["ops_ms"]["adamw"]
    kernels_ms = products_ms + attention_ms + adamw_ms

    flops_per_token = run["model_tflops_per_rank"] * 1e12 / run["median_tokens_per_s"]
    step_ms = tokens / run["median_tokens_per_s"] * 1e3
    tokens_per_s = tokens / (kernels_ms * 1e-3)
    budget = {
        "$comment": f"tools/capstone_budget.py: one dense-135M step ({tokens:,} tokens) with only its GEMMs (capstone_gemms, each product at its rate alone on the kernels course mode runs it on: 05 forward and input gradients, 10's weight gradient in groups of tokens), its attention forward and backward calls, one each a layer (attention/experiment/capstone_shape/{attention_run}) and AdamW (capstone/dense-135m course bf16 in the reference) costing anything; the tokens/s and ratio to cuBLAS bf16 that would give, with the model FLOPs a token and the cuBLAS rate of that reference run; that run's measured step beside it (its build may predate the attention run's: the rest then carries their difference); and goal_rest_ms, what the rest of the step could take at the goal's ratio ({GOAL}).",
        "gemms_ms": round(products_ms, 3),
        "gemms_tflops": round(products_tflop / (products_ms * 1e-3), 1),
        "attention_ms": round(attention_ms, 3),
        "adamw_ms": round(adamw_ms, 3),
        "kernels_ms": round(kernels_ms, 3),
        "kernels_tokens_per_s": round(tokens_per_s),
        "kernels_ratio": round(tokens_per_s * flops_per_token / (run["cublas_bf16_tflops"] * 1e12), 4),
        "measured_step_ms": round(step_ms, 3),
        "measured_ratio": round(run["ratio"], 4),
        "rest_ms": round(step_ms - kernels_ms, 3),
    }
    ratio = tokens_per_s * flops_per_token / (run["cublas_bf16_tflops"] * 1e12)
    budget["goal_rest_ms"] = round(kernels_ms * (ratio / GOAL - 1.0), 3)
    # The least the memory-bound operations can cost while each stays a pass of its own, as the
    # course's modules make them: their bytes at the fastest stream through memory measured on
    # this GPU (a read-only pass, faster than a copy), for the run's fp32 residual stream and for
    # a bf16 one (--residual bf16). The kernels plus that floor are the ceiling of this division
    # of the work; only fusing the operations moves it.
    stream_gbs = lab["inference"]["decode_pages"]["read_only_gbs"]["pages_in_order"]
    budget["$comment"] += (" memory_floor_f32_stream / memory_floor_bf16_stream: the step's memory-bound operations "
                           "(norms, RoPE, SwiGLU, the residual adds, cross-entropy, the embedding), each one pass "
                           "reading and writing its operands once (bf16 activations, the residual stream in fp32 or "
                           "bf16), their bytes at stream_gbs (the fastest stream through memory measured on this GPU: "
                           "inference/decode_pages/read_only_gbs/pages_in_order in the lab file, a read-only pass, "
                           "against the copy rate copy_gbs of the reference's ceilings) by part, and "
                           "unfused_ceiling_ratio, the ratio with those passes added to the kernels alone.")
    budget["stream_gbs"] = round(stream_gbs, 1)
    budget["copy_gbs"] = round(reference["ceilings"][COPY]["value"], 1)
    for stream, nbytes in (("f32", 4), ("bf16", 2)):
        parts = memory_floor(run, tokens, nbytes)
        gb = sum(parts.values())
        floor_ms = gb / stream_gbs * 1e3
        budget[f"memory_floor_{stream}_stream"] = {
            "gb": round(gb, 3),
            "ms_by_part": {k: round(v / stream_gbs * 1e3, 3) for k, v in parts.items()},
            "ms": round(floor_ms, 3),
            "unfused_ceiling_ratio": round(ratio * kernels_ms / (kernels_ms + floor_ms), 4),
        }
    # Where the run has the in-step clock: the rest of the step by part. The parts are in-step
    # times, the budget's are times alone, and the in-step clock is a step of its own, so what
    # the parts leave of rest_ms is the two clocks' difference ("unattributed").
    in_step = run.get("ops_in_step_ms")
    if in_step:
        parts = {}
        for name, ops in REST_GROUPS.items():
            parts[name] = sum(in_step.get(op, 0.0) for op in ops)
        known = set(PRODUCT_OPS) | set(ATTENTION_OPS) | {"adamw", BETWEEN} | {op for ops in REST_GROUPS.values() for op in ops}
        parts["other operations"] = sum(ms for op, ms in in_step.items() if op not in known)
        parts["products beyond their kernels alone"] = sum(in_step[op] for op in PRODUCT_OPS) - products_ms
        parts["attention beyond its calls alone"] = sum(in_step[op] for op in ATTENTION_OPS) - attention_ms
        parts["adamw in the step beyond alone"] = in_step["adamw"] - adamw_ms
        parts["between operations"] = in_step.get(BETWEEN, 0.0)
        parts["unattributed"] = budget["rest_ms"] - sum(parts.values())
        budget["$comment"] += (" rest_by_part: rest_ms split by the run's in-step clock (ops_in_step_ms): the memory-bound "
                               "operations by group (rmsnorm: forward and backward, likewise swiglu; 'other operations': "
                               "every operation not named here), the products', attention's and AdamW's in-step times "
                               "less their times in this budget (for the products: course mode's passes around 05 and 10, "
                               "conversions, partial sums), the gaps between operations, and what is left of rest_ms "
                               "(the in-step clock's step against the measured median step).")
        budget["rest_by_part"] = {k: round(v, 3) for k, v in parts.items()}
    # Where the run has the host's part of each operation: what the CPU spends issuing one step's
    # work (the operations that read a result back left out), against the measured step.
    host = run.get("ops_host_ms")
    if host:
        issue_ms = sum(ms for op, ms in host.items() if op not in READ_BACK)
        budget["$comment"] += (" host_issue_ms: the host's part of the timed step's operations, those that hand a result "
                               "back to the host left out; host_issue_share: that over measured_step_ms.")
        budget["host_issue_ms"] = round(issue_ms, 3)
        budget["host_issue_share"] = round(issue_ms / step_ms, 4)
    return budget


def read(path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"capstone_budget: cannot read {path}: {e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="record the budget in the lab file")
    mode.add_argument("--check", action="store_true", help="exit 1 unless the recorded budget is the one computed now")
    ap.add_argument("--lab", type=pathlib.Path, default=LAB, help=f"lab results (default {LAB.relative_to(ROOT)})")
    ap.add_argument("--reference", type=pathlib.Path, default=REFERENCE,
                    help=f"reference timings (default {REFERENCE.relative_to(ROOT)})")
    ap.add_argument("--attention-run", default=SHIPPED, help=f"the run of capstone_shape to take (default {SHIPPED})")
    args = ap.parse_args()
    lab, reference = (read(path) for path in (args.lab, args.reference))
    try:
        run = reference["capstone"][RUN]
    except (KeyError, TypeError):
        raise SystemExit(f"capstone_budget: {args.reference} has no capstone/{RUN} entry")
    try:
        budget = budget_of(lab, reference, run, args.attention_run)
    except (KeyError, TypeError) as e:
        raise SystemExit(f"capstone_budget: a measurement is missing ({e}) in {args.lab} or {args.reference}; "
                         "see this tool's docstring for what it reads")
    if args.check:
        recorded = lab.get("capstone_budget") or {}
        if recorded == budget:
            print(f"capstone_budget: {args.lab} holds the budget its measurements give")
            return
        stale = [k for k in sorted(set(budget) | set(recorded)) if recorded.get(k) != budget.get(k)]
        raise SystemExit(f"capstone_budget: {args.lab}'s capstone_budget is stale or missing ({', '.join(stale)}): "
                         "run tools/capstone_budget.py --write, then tools/figures.py --write")
    def show(key, value):
        if isinstance(value, dict):
            for part, inner in value.items():
                show(f"{key}: {part}", inner)
        elif not key.startswith("$"):
            print(f"{key:60s} {value}")

    for key, value in budget.items():
        show(key, value)
    if "host_issue_ms" not in budget:
        print(f"(the reference's {RUN} run has no ops_host_ms: a k2c_capstone --time-ops run of this build adds "
              "the host's part)")
    if args.write:
        lab["capstone_budget"] = budget
        args.lab.write_text(json.dumps(lab, indent=1, ensure_ascii=False) + "\n")
        print(f"capstone_budget written to {args.lab}")


if __name__ == "__main__":
    main()
