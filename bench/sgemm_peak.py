#!/usr/bin/python3
"""The matmul FLOP/s at a transformer's matmul shapes, one thread, in the dtype the model
computes in, as one rank of a run computes them: the bound that model FLOP utilisation (MFU) is
taken against.

Shapes, for M = tokens one rank computes in a micro-batch and d = n_embd: the fused QKV
(M x d by d x 3d, or d x (d + 2·kv·d/heads) with grouped-query heads), the attention output
(d x d), the MLP up (d x f; Llama's gate and up alike) and down (f x d), and the LM head
(d x vocab). Each is timed forward as y = x @ w (the backward's two matmuls per weight have
the same FLOPs and comparable shapes). PyTorch's torch.mm calls the same libblas.so.3 as
LibTorch in cai's ranks. --dtype is the run's compute dtype: fp32 calls the BLAS's sgemm;
bf16 calls LibTorch's bf16 matmul (oneDNN where the build has it), which is a different kernel
with a different peak, so a bf16 run measured against the fp32 sgemm would read above 100%;
fp16 computes in fp32 on the CPU (LibTorch 1.13 has no CPU fp16 matmul), so its bound is fp32's.
Prints one JSON line: per shape GFLOP/s (median of --reps after one warm-up), the peak (their
maximum, so that no matmul of the model can run faster) and the dtype measured.

usage: bench/sgemm_peak.py --tokens M --n-embd d --ffn f --qkv N --vocab V
                           [--dtype fp32|bf16|fp16] [--reps 5]
"""
import argparse
import json
import time

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("tokens", "n-embd", "ffn", "qkv", "vocab"):
        p.add_argument("--" + name, type=int, required=True)
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    d = a.n_embd
    shapes = {"qkv": (a.tokens, d, a.qkv), "attn_out": (a.tokens, d, d),
              "mlp_up": (a.tokens, d, a.ffn), "mlp_down": (a.tokens, a.ffn, d),
              "lm_head": (a.tokens, d, a.vocab)}
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    rates = {}
    for name, (m, k, n) in shapes.items():
        x, w = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        torch.mm(x, w)
        times = []
        for _ in range(a.reps):
            start = time.perf_counter()
            torch.mm(x, w)
            times.append(time.perf_counter() - start)
        rates[name] = 2.0 * m * k * n / sorted(times)[len(times) // 2] / 1e9
    print(json.dumps({"gflops": rates, "peak_gflops": max(rates.values()),
                      "dtype": "bf16" if dtype == torch.bfloat16 else "fp32",
                      "shapes": {k: list(v) for k, v in shapes.items()}}))


if __name__ == "__main__":
    main()
