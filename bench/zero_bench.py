#!/usr/bin/python3
"""libcai_low_level_zero against PyTorch's ZeroRedundancyOptimizer over DDP on the same GPT-2.

The protocol of bench/ddp_bench.py (whose job, runner and options this reuses): 2 ranks on this
machine over Gloo, OMP_NUM_THREADS=1 per rank (cai: train.threads = 1), cai and peer runs
alternating, the figure the median over pairs of the per-pair ratio. Reported per pair:
tokens/s (global tokens per step over the median step time after the first step, the same
definition on both sides) and the largest peak RSS of a rank; for cai also, per rank, the
bytes handed to reduce-scatter and all-gather in a step (Ψ·4 reduced, Ψ·4/N gathered at fp32:
Ψ over all ranks) and the optimizer-state + master bytes it holds (8Ψ/N for AdamW at fp32).

PyTorch's ZeroRedundancyOptimizer is ZeRO-1 (DDP all-reduces full gradients; each rank steps
the parameters it owns and broadcasts them); cai runs stage 1 by default (--stage 2 for ZeRO-2).

usage: bench/zero_bench.py BUILD_DIR [--pairs 3] [--steps 12] [--stage 1|2] [--malloc-tunables]
"""
import argparse
import statistics
import tempfile
from pathlib import Path

from ddp_bench import add_job_options, peer_command, run_cai, run_peer_command


def run_zero(build, args, work, index):
    table = f"\n[plugin.low_level_zero]\nstage = {args.stage}\n"
    summary = run_cai(build, args, work, index, "low_level_zero", table)
    ranks = summary["ranks"]
    return {"tokens_per_s": summary["tokens_per_s"],
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
            "reduced": [r["comm_bytes_per_step_mean"]["reduce_scatter"] for r in ranks],
            "gathered": [r["comm_bytes_per_step_mean"]["all_gather"] for r in ranks],
            "sharded": [r["strategy_bytes"]["optimizer_state"] + r["strategy_bytes"]["master"]
                        for r in ranks]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build", type=Path, help="build directory with bin/cai and libcai_low_level_zero")
    add_job_options(p)
    p.add_argument("--stage", type=int, default=1, choices=(1, 2))
    args = p.parse_args()
    speed, rss = [], []
    print(f"{'pair':>4} {'cai tok/s':>10} {'torch tok/s':>11} {'ratio':>6} "
          f"{'cai RSS MiB':>11} {'torch RSS MiB':>13} {'ratio':>6} "
          f"{'reduce-scatter B/rank':>22} {'all-gather B/rank':>19} {'state+master B/rank':>20} "
          f"{'4Ψ B':>9}")
    with tempfile.TemporaryDirectory(prefix="zero_bench_") as tmp:
        for i in range(args.pairs):
            cai = run_zero(args.build.resolve(), args, Path(tmp), i)
            peer = run_peer_command(args, peer_command(args, "zero_gpt2_torch.py"))
            speed.append(cai["tokens_per_s"] / peer["tokens_per_s"])
            rss.append(cai["peak_rss_bytes"] / peer["peak_rss_bytes"])
            print(f"{i + 1:>4} {cai['tokens_per_s']:>10.0f} {peer['tokens_per_s']:>11.0f} "
                  f"{speed[-1]:>6.3f} {cai['peak_rss_bytes'] / 2**20:>11.1f} "
                  f"{peer['peak_rss_bytes'] / 2**20:>13.1f} {rss[-1]:>6.3f} "
                  f"{str(cai['reduced']):>22} {str(cai['gathered']):>19} "
                  f"{str(cai['sharded']):>20} {4 * peer['params']:>9}", flush=True)
    print(f"median tokens/s ratio cai/torch: {statistics.median(speed):.3f}; "
          f"median peak RSS ratio cai/torch: {statistics.median(rss):.3f}")


if __name__ == "__main__":
    main()
