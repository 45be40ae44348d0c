#!/usr/bin/env python3
"""The ceiling of the capstone's course mode on one GPU: what a dense-135M step would take if only
its GEMMs, its attention calls and AdamW cost anything, each at the time it was measured alone.

    python3 tools/capstone_budget.py [--write]

Reads the measurements it adds up, all from one GPU's files:
  lab/results/h200.json        capstone_gemms/step (the step's products on module 05 forward and
                               module 10 backward, weighted by their calls), and
                               attention/experiment/capstone_shape (module 09's Part B forward and
                               backward calls at the capstone's shape, two processes: the mean)
  autograder/reference/h200.json
                               capstone/dense-135m course bf16 (AdamW's time, the model FLOPs a
                               token, the run's tokens/s and its cuBLAS bf16 rate)
and prints the budget: the sum, the tokens/s and ratio to cuBLAS it would give, and what the rest
of the measured step costs. --write records it as capstone_budget in lab/results/h200.json, where
the docs read it from (tools/figures.py).
"""
import argparse
import json
import pathlib
import statistics

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAB = ROOT / "lab/results/h200.json"
REFERENCE = ROOT / "autograder/reference/h200.json"
RUN = "dense-135m course bf16"
TOKENS = 16 * 1024  # a step of tools/capstone-runs.sh: batch 16 x 1024 tokens
LAYERS = 12         # dense-135M: one attention forward and backward call per layer


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="record the budget in lab/results/h200.json")
    args = ap.parse_args()
    lab = json.loads(LAB.read_text())
    run = json.loads(REFERENCE.read_text())["capstone"][RUN]

    gemm_ms = lab["capstone_gemms"]["step"]["05_forward_10_backward_ms"]
    shape = lab["attention"]["experiment"]["capstone_shape"]
    runs = [shape[k] for k in sorted(shape) if k.startswith("run")]
    forward = statistics.mean(r["forward: Part B forward (shipped at d = 64)"]["ms"] for r in runs)
    backward = statistics.mean(r["backward: Part B (shipped)"]["ms"] for r in runs)
    attention_ms = LAYERS * (forward + backward)
    adamw_ms = run["ops_ms"]["adamw"]
    kernels_ms = gemm_ms + attention_ms + adamw_ms

    flops_per_token = run["model_tflops_per_rank"] * 1e12 / run["median_tokens_per_s"]
    step_ms = TOKENS / run["median_tokens_per_s"] * 1e3
    tokens_per_s = TOKENS / (kernels_ms * 1e-3)
    budget = {
        "$comment": "tools/capstone_budget.py: one dense-135M step (16,384 tokens) with only its GEMMs (capstone_gemms/step, 05 forward and 10 backward), its 12 attention forward and backward calls (attention/experiment/capstone_shape, the mean of its runs) and AdamW (capstone.dense-135m course bf16 in the reference) costing anything, each at its time alone; the tokens/s and ratio to cuBLAS bf16 that would give, with the model FLOPs a token and the cuBLAS rate of that reference run; and the measured step's time beside it.",
        "gemms_ms": round(gemm_ms, 3),
        "attention_ms": round(attention_ms, 3),
        "adamw_ms": round(adamw_ms, 3),
        "kernels_ms": round(kernels_ms, 3),
        "kernels_tokens_per_s": round(tokens_per_s),
        "kernels_ratio": round(tokens_per_s * flops_per_token / (run["cublas_bf16_tflops"] * 1e12), 4),
        "measured_step_ms": round(step_ms, 3),
        "measured_ratio": round(run["ratio"], 4),
        "rest_ms": round(step_ms - kernels_ms, 3),
    }
    for key, value in budget.items():
        if not key.startswith("$"):
            print(f"{key:22s} {value}")
    if args.write:
        lab["capstone_budget"] = budget
        LAB.write_text(json.dumps(lab, indent=1, ensure_ascii=False) + "\n")
        print(f"capstone_budget written to {LAB.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
