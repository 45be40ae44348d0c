#!/usr/bin/env python3
"""The ceiling of the capstone's course mode on one GPU: what a dense-135M step would take if only
its GEMMs, its attention calls and AdamW cost anything, each at the time it was measured alone.

    python3 tools/capstone_budget.py [--write] [--lab FILE] [--reference FILE]

Reads the measurements it adds up, all from one GPU's files:
  lab/results/h200.json        capstone_gemms (each product of the step timed alone; weighted
                               here by its calls, on the kernels course mode runs it on: module 05
                               for the forward and input-gradient products, module 10's weight
                               gradient split into groups of tokens), and
                               attention/experiment/capstone_shape (module 09's Part B forward and
                               backward calls at the capstone's shape; SHIPPED names the run of
                               the shipped build)
  autograder/reference/h200.json
                               capstone/dense-135m course bf16 (AdamW's time, the model FLOPs a
                               token, the run's tokens/s and its cuBLAS bf16 rate)
and prints the budget: the sum, the tokens/s and ratio to cuBLAS it would give, and what the rest
of the measured step costs. --write records it as capstone_budget in the lab file, where the docs
read it from (tools/figures.py). --lab and --reference point at another GPU's files (default: the
H200's).
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
SHIPPED = "run3"  # capstone_shape's run of the shipped build of module 09
GOAL = 0.62  # the module's goal: model FLOP rate over cuBLAS bf16 (README's course map, lecture 18 section 3)


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


def budget_of(lab, run):
    """The budget (a dict for lab results) from the measurements; KeyError where one is missing."""
    # The step's shape: layers and sequence length from the run's model, tokens from the products.
    layers = int(re.search(r"(\d+) layers", run["model"]).group(1))
    seq = int(re.search(r"T (\d+)", run["model"]).group(1))
    tokens = lab["capstone_gemms"]["q, k, v, o forward"]["M"]
    if tokens % seq:
        raise SystemExit(f"capstone_budget: {tokens} tokens are not whole sequences of {seq}")

    products_ms, products_tflop = gemm_step(lab["capstone_gemms"], layers)
    shipped = lab["attention"]["experiment"]["capstone_shape"][SHIPPED]
    forward = shipped["forward: Part B forward (shipped at d = 64)"]["ms"]
    backward = shipped["backward: Part B (shipped)"]["ms"]
    attention_ms = layers * (forward + backward)
    adamw_ms = run["ops_ms"]["adamw"]
    kernels_ms = products_ms + attention_ms + adamw_ms

    flops_per_token = run["model_tflops_per_rank"] * 1e12 / run["median_tokens_per_s"]
    step_ms = tokens / run["median_tokens_per_s"] * 1e3
    tokens_per_s = tokens / (kernels_ms * 1e-3)
    budget = {
        "$comment": "tools/capstone_budget.py: one dense-135M step (16,384 tokens) with only its GEMMs (capstone_gemms, each product at its rate alone on the kernels course mode runs it on: 05 forward and input gradients, 10's weight gradient in groups of tokens), its attention forward and backward calls, one each a layer (attention/experiment/capstone_shape, its run of the shipped build) and AdamW (capstone.dense-135m course bf16 in the reference) costing anything; the tokens/s and ratio to cuBLAS bf16 that would give, with the model FLOPs a token and the cuBLAS rate of that reference run; the measured step's time beside it; and goal_rest_ms, what the rest of the step could take at the goal's ratio (0.62).",
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
    ratio = budget["kernels_ratio"]
    budget["goal_rest_ms"] = round(kernels_ms * (ratio / GOAL - 1.0), 3)
    return budget


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="record the budget in the lab file")
    ap.add_argument("--lab", type=pathlib.Path, default=LAB, help=f"lab results (default {LAB.relative_to(ROOT)})")
    ap.add_argument("--reference", type=pathlib.Path, default=REFERENCE,
                    help=f"reference timings (default {REFERENCE.relative_to(ROOT)})")
    args = ap.parse_args()
    try:
        lab = json.loads(args.lab.read_text())
        run = json.loads(args.reference.read_text())["capstone"][RUN]
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise SystemExit(f"capstone_budget: cannot read the measurements: {e!r}")
    try:
        budget = budget_of(lab, run)
    except KeyError as e:
        raise SystemExit(f"capstone_budget: a measurement is missing: {e} (see this tool's docstring for what it reads)")
    for key, value in budget.items():
        if not key.startswith("$"):
            print(f"{key:22s} {value}")
    if args.write:
        lab["capstone_budget"] = budget
        args.lab.write_text(json.dumps(lab, indent=1, ensure_ascii=False) + "\n")
        print(f"capstone_budget written to {args.lab}")


if __name__ == "__main__":
    main()
