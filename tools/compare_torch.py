#!/usr/bin/env python3
"""Measure PyTorch's scaled-dot-product-attention backends on module 09's benchmark shapes, for
the benchmark report to place beside the course's own figures. Optional: PyTorch is not a
dependency of the course, and this script only runs where it is installed with CUDA.

    tools/compare_torch.py [--out torch_attention.json] [--n 512 1024 ... 16384] [--d 64 128]

Shapes follow bench_flash_attention.cu: 16384 tokens per call (batch = 16384 / N), 2048 channels
(heads = 2048 / d), bf16, causal and not; plus the graded shape B 4, H 32, N 4096, d 128 causal.
Backends: flash (FlashAttention 2), cudnn, efficient (memory-efficient), math (the materialising
version, the counterpart of naive_forward). FLOPs as the course counts them: 4·B·H·N²·d forward,
halved when causal, 2.5x that backward. Timing: CUDA events, median of --repeats runs after
warm-up. A backend that is unavailable for a shape is recorded with its error, not skipped
silently.
"""
import argparse
import json
import sys

import k2c_tools


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="torch_attention.json")
    ap.add_argument("--n", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    torch = k2c_tools.need_torch("PyTorch with torch.nn.attention")
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        import torch.nn.functional as F
    except ImportError as e:
        sys.exit(f"PyTorch with torch.nn.attention is needed for this comparison ({e}); nothing measured")

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}

    def timed(fn):
        return k2c_tools.median_ms(torch, fn, args.repeats, warmup=3)

    shapes = [(4, 32, 4096, 128, True)]
    shapes += [(16384 // n, 2048 // d, n, d, causal) for d in args.d for causal in (True, False) for n in args.n]
    results = []
    for batch, heads, n, d, causal in shapes:
        flops = 4.0 * batch * heads * n * n * d * (0.5 if causal else 1.0)
        q, k, v = (torch.empty(batch, heads, n, d, device="cuda", dtype=torch.bfloat16).uniform_(-2, 2)
                   for _ in range(3))
        v.uniform_(-1, 1)
        for name, backend in backends.items():
            # The materialising backend at long sequences needs B·H·N² scores several times over.
            if name == "math" and batch * heads * n * n * 4 * 3 > torch.cuda.get_device_properties(0).total_memory // 2:
                continue
            row = {"backend": name, "batch": batch, "heads": heads, "n": n, "d": d, "causal": causal}
            try:
                with sdpa_kernel(backend):
                    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                    fwd = lambda: F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                    row["forward_ms"] = timed(fwd)
                    out = fwd()
                    grad = torch.empty_like(out).uniform_(-1, 1)
                    bwd = lambda: torch.autograd.grad(out, (qg, kg, vg), grad, retain_graph=True)
                    row["backward_ms"] = timed(bwd)
                row["forward_tflops"] = flops / row["forward_ms"] * 1e-9
                row["backward_tflops"] = 2.5 * flops / row["backward_ms"] * 1e-9
                print(f"{name:9s} B{batch} H{heads} N{n} d{d} {'causal' if causal else 'full  '}  "
                      f"fwd {row['forward_tflops']:6.1f}  bwd {row['backward_tflops']:6.1f} TFLOP/s", flush=True)
            except Exception as e:  # an unsupported shape or backend: say so in the report
                row["error"] = str(e).splitlines()[0]
                print(f"{name:9s} B{batch} H{heads} N{n} d{d}: {row['error']}", flush=True)
            results.append(row)
            torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "note": "is_causal=True is top-left aligned in PyTorch; identical to the course's convention when q_len == kv_len",
              "results": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
