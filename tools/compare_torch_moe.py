#!/usr/bin/env python3
"""Measure PyTorch on module 10's benchmark shape, for the report to place beside the course's
own figures. Optional: PyTorch is not a dependency of the course, and this script only runs where
it is installed with CUDA.

    tools/compare_torch_moe.py [--out torch_moe.json] [--repeats 20]

Shape as in bench_moe.cu: 16384 tokens, hidden 2048, 64 experts of width 1408, top-6, two shared
experts (2816 wide together), bf16; every token picks 6 distinct experts uniformly. Measured:
  loop         the up projection [g|u] = x_e W13_e^T as one torch.matmul per expert (Python loop)
  grouped_mm   the same GEMM as one torch._grouped_mm call (where this PyTorch has it)
  naive_layer  the whole layer's forward + backward written the plain way: router linear,
               softmax, top-k, then per expert a nonzero() to find its tokens, three F.linear
               calls, SwiGLU and an index_add_ of the weighted output; autograd for the backward
FLOPs as the course counts them. Timing: CUDA events around each run, L2 flushed before it (a
buffer twice the L2 size overwritten), median of the runs after warm-up. A measurement that
fails is recorded with its error, not skipped silently.
"""
import argparse
import json

import k2c_tools

T, D, E, F_, K, SF = 16384, 2048, 64, 1408, 6, 2816


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="torch_moe.json")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch = k2c_tools.need_torch()
    import torch.nn.functional as F

    dev = "cuda"
    flush = torch.empty(2 * torch.cuda.get_device_properties(0).L2_cache_size // 4 + 1, device=dev)

    def timed(fn, repeats):
        return k2c_tools.median_ms(torch, fn, repeats, warmup=2, before=flush.zero_)

    torch.manual_seed(1)
    choice = torch.rand(T, E, device=dev).topk(K, dim=1).indices
    counts = torch.bincount(choice.flatten(), minlength=E)
    ends = counts.cumsum(0).to(torch.int32)
    rows = int(ends[-1])
    host_counts = counts.tolist()
    x = torch.empty(rows, D, device=dev, dtype=torch.bfloat16).uniform_(-1, 1)
    w13 = torch.empty(E, 2 * F_, D, device=dev, dtype=torch.bfloat16).uniform_(-0.066, 0.066)
    out = torch.empty(rows, 2 * F_, device=dev, dtype=torch.bfloat16)
    gemm_flops = 2.0 * rows * 2 * F_ * D
    results = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "shape": {"tokens": T, "hidden": D, "experts": E, "ffn": F_, "top_k": K, "shared_ffn": SF},
               "max_over_mean": max(host_counts) / (rows / E)}

    def loop():
        start = 0
        for e, c in enumerate(host_counts):
            torch.matmul(x[start:start + c], w13[e].t(), out=out[start:start + c])
            start += c

    ms = timed(loop, args.repeats)
    results["loop"] = {"ms": ms, "TFLOP/s": gemm_flops / ms / 1e9}
    try:
        w13t = w13.transpose(-2, -1)  # [E][D][2F], the layout grouped_mm multiplies by
        ms = timed(lambda: torch._grouped_mm(x, w13t, offs=ends), args.repeats)
        results["grouped_mm"] = {"ms": ms, "TFLOP/s": gemm_flops / ms / 1e9}
    except Exception as e:  # an older PyTorch, or a GPU it does not support there
        results["grouped_mm"] = {"error": str(e)[:300]}

    # The naive layer, forward + backward.
    try:
        xt = torch.empty(T, D, device=dev, dtype=torch.bfloat16).uniform_(-1, 1).requires_grad_()
        dy = torch.empty(T, D, device=dev, dtype=torch.bfloat16).uniform_(-1, 1)
        wr = torch.empty(E, D, device=dev, dtype=torch.bfloat16).uniform_(-0.1, 0.1).requires_grad_()
        w1 = w13[:, :F_].clone().requires_grad_()
        w3 = w13[:, F_:].clone().requires_grad_()
        w2 = torch.empty(E, D, F_, device=dev, dtype=torch.bfloat16).uniform_(-0.08, 0.08).requires_grad_()
        s13 = torch.empty(2 * SF, D, device=dev, dtype=torch.bfloat16).uniform_(-0.066, 0.066).requires_grad_()
        s2 = torch.empty(D, SF, device=dev, dtype=torch.bfloat16).uniform_(-0.056, 0.056).requires_grad_()

        params = [xt, wr, w1, w3, w2, s13, s2]

        def layer():
            for p in params:
                p.grad = None
            probs = F.linear(xt, wr).float().softmax(dim=-1)
            weight, expert = probs.topk(K, dim=-1)
            y = F.linear(F.silu(F.linear(xt, s13[:SF])) * F.linear(xt, s13[SF:]), s2).float()
            for e in range(E):
                token, slot = (expert == e).nonzero(as_tuple=True)
                if token.numel() == 0:
                    continue
                xe = xt[token]
                he = F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e])
                y = y.index_add(0, token, F.linear(he, w2[e]).float() * weight[token, slot, None])
            y.to(torch.bfloat16).backward(dy)

        ms = timed(layer, max(3, args.repeats // 4))
        flops = 3 * (6.0 * T * K * D * F_ + 6.0 * T * D * SF)
        results["naive_layer"] = {"ms": ms, "TFLOP/s": flops / ms / 1e9}
    except Exception as e:
        results["naive_layer"] = {"error": str(e)[:300]}

    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
