#!/usr/bin/python3
"""What the call check (launch.check_calls, on by default) costs per training step.

Runs the same 2-rank ddp GPT-2 job with the check on and off, alternating on/off runs so that
load drifting on a shared machine hits both alike, and prints per setting the median step time
of each run (summary.json's median_step_time_s: the median over the steps after the first),
then the median, min and max over runs, and the per-step cost (median on - median off). Also
prints the collectives one step issues, to turn it into a cost per collective.

usage: bench/call_check_bench.py BUILD_DIR [--pairs 5] [--steps 20] [--n-layer 2]
                                 [--n-embd 32] [--n-head 2] [--seq-len 16] [--global-batch 6]
"""
import argparse
import statistics
import tempfile
from pathlib import Path

from benchlib import run_cai


def run(build, job, run_dir, check):
    summary = run_cai(build, job, run_dir, "ddp",
                      sets=(f"launch.check_calls={str(check).lower()}",))
    return summary["median_step_time_s"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("build_dir")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=32)
    parser.add_argument("--n-head", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--global-batch", type=int, default=6)
    args = parser.parse_args()
    build = Path(args.build_dir).resolve()
    job = argparse.Namespace(**vars(args), kind="gpt2", vocab_size=256, n_ctx=args.seq_len,
                             n_kv_head=0, precision="fp32", nproc=2, timeout=600)
    n = args.n_embd
    params = 12 * args.n_layer * n * n + 256 * n + args.seq_len * n
    times = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="call_check_bench_") as tmp:
        for pair in range(args.pairs):
            for check in (True, False) if pair % 2 == 0 else (False, True):
                times[check].append(run(build, job, Path(tmp) / f"run-{pair}-{check}", check))
    print(f"2 ranks, ddp, GPT-2 n_layer={args.n_layer} n_embd={args.n_embd} (~{params / 1e6:.1f}M "
          f"params), {args.global_batch}x{args.seq_len} tokens per step, {args.steps} steps, "
          f"{args.pairs} on/off pairs")
    for check in (True, False):
        t = times[check]
        print(f"check_calls={str(check).lower():5}  median step {statistics.median(t) * 1e3:8.2f} ms"
              f"  min {min(t) * 1e3:8.2f}  max {max(t) * 1e3:8.2f}  runs: "
              + " ".join(f"{x * 1e3:.2f}" for x in t))
    cost = statistics.median(times[True]) - statistics.median(times[False])
    print(f"cost per step: {cost * 1e3:+.2f} ms ({cost / statistics.median(times[False]) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
