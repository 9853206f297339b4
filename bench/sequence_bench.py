#!/usr/bin/python3
"""Activation memory per rank against sequence length under libcai_hybrid_parallel's sequence
parallelism (split_gather, over tp_size 2), tensor parallelism alone (tp_size 2) and one rank,
and the longest sequence each would fit in a memory limit per rank, extrapolated.

Memory: LibTorch's peak over the training steps (summary.json framework_step_peak_bytes, the
largest rank's), which holds the activations and the step's temporaries; the parameters,
gradients and optimizer state live in the strategy's buffers and are reported apart. The
attention is the memory-efficient kernel (model.memory_efficient_attention), so nothing grows
as T²: what is left grows linearly with T, and sequence parallelism divides all of it by tp.

Longest sequence: the peak is a + b·T (fitted through the two longest lengths measured); the
T where it reaches --limit-gib per rank is extrapolated, not run (the attention's compute grows
as T², so a run at that length would take hours on this machine's two cores).

usage: bench/sequence_bench.py BUILD_DIR [--lengths 1024,2048,4096,8192] [--limit-gib 10]
                               [job sizes of benchlib.py]
"""
import argparse
import tempfile
from pathlib import Path

from benchlib import add_job_options, run_cai

MODES = {
    "1 rank": (1, ""),
    "tp 2": (2, "tp_size = 2\n"),
    "tp 2 + split_gather": (2, "tp_size = 2\nenable_sequence_parallelism = true\n"),
}


def peak(build, args, work, mode, t):
    nproc, table = MODES[mode]
    args.nproc = nproc
    args.seq_len = args.n_ctx = t
    run_dir = work / f"{mode.replace(' ', '_').replace('+', '')}-{t}"
    summary = run_cai(build, args, run_dir, "hybrid_parallel",
                      "\n[plugin.hybrid_parallel]\n" + table,
                      sets=("model.memory_efficient_attention=true", "data.eval_fraction=0"))
    return max(r["framework_step_peak_bytes"] for r in summary["ranks"]), summary["blas"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build", type=Path)
    add_job_options(p, pairs=1)
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--limit-gib", dest="limit_gib", type=float, default=10.0)
    p.set_defaults(steps=2, global_batch=2, n_layer=2, n_embd=256, n_head=8, timeout=1800)
    args = p.parse_args()
    build = args.build.resolve()
    lengths = [int(t) for t in args.lengths.split(",")]
    mib = 2 ** 20
    print(f"GPT-2 n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head}, "
          f"global batch {args.global_batch}, memory-efficient attention; LibTorch's peak over "
          f"the steps per rank, MiB")
    print(f"{'T':>6} " + " ".join(f"{m:>20}" for m in MODES) + f" {'split_gather/1 rank':>20}")
    blas = ""
    with tempfile.TemporaryDirectory(prefix="sequence_bench_") as tmp:
        before, last = {}, {}
        for t in lengths:
            row = {}
            for mode in MODES:
                row[mode], blas = peak(build, args, Path(tmp), mode, t)
            print(f"{t:>6} " + " ".join(f"{row[m] / mib:>20.1f}" for m in MODES) +
                  f" {row['tp 2 + split_gather'] / row['1 rank']:>20.3f}", flush=True)
            before, last = last, row
        print(f"BLAS: {blas}")
        limit = args.limit_gib * 2 ** 30
        print(f"\nlongest sequence within {args.limit_gib:g} GiB of LibTorch's memory per rank "
              f"(a + b·T through T = {lengths[-2]} and {lengths[-1]}, extrapolated):")
        for mode in MODES:
            slope = (last[mode] - before[mode]) / (lengths[-1] - lengths[-2])
            base = last[mode] - slope * lengths[-1]
            print(f"  {mode:>20}: {slope / 1024:.1f} KiB per token, T ≈ "
                  f"{int((limit - base) / slope):,}", flush=True)

if __name__ == "__main__":
    main()
