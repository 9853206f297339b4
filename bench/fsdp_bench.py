#!/usr/bin/python3
"""libcai_fsdp against PyTorch DDP, DDP + ZeroRedundancyOptimizer and libcai_low_level_zero
stage 2 on the same GPT-2 job.

PyTorch 1.13's FullyShardedDataParallel refuses to run without CUDA, so on CPU the PyTorch
peers are DDP and DDP + ZeroRedundancyOptimizer (python3-torch, Gloo). The protocol, job and
runners of bench/benchlib.py, the four runs of a pair one after the other. Per pair: tokens/s
and the largest peak RSS of a rank; for fsdp also the bytes per rank and step handed to
all-gather and reduce-scatter, whose sum over ranks is ZeRO-3's 3Ψ (2 gathers of 4Ψ/N per rank,
1 reduce-scatter of 4Ψ), and the pool's device peak (model state + gathered units) against
low_level_zero's.

Targets (issue 7): fsdp's peak RSS below both PyTorch peers' at >= 0.8x PyTorch DDP's tokens/s.

usage: bench/fsdp_bench.py BUILD_DIR [--pairs 3] [--steps 12] [job sizes of benchlib.py]
                           [--strategy FULL_SHARD|SHARD_GRAD_OP] [--prefetch]
"""
import argparse
import statistics
import tempfile
from pathlib import Path

from benchlib import add_job_options, cai_figures, peer_command, run_cai, run_peer


def run_fsdp(build, args, work, index):
    table = f'\n[plugin.fsdp]\nsharding_strategy = "{args.strategy}"\n'
    if args.prefetch:
        table += 'forward_prefetch = true\nbackward_prefetch = "pre"\n'
    summary = run_cai(build, args, work / f"fsdp-{index}", "fsdp", table)
    ranks = summary["ranks"]
    return dict(cai_figures(summary),
                gathered=[r["comm_bytes_per_step_mean"]["all_gather"] for r in ranks],
                reduced=[r["comm_bytes_per_step_mean"]["reduce_scatter"] for r in ranks])


def run_zero2(build, args, work, index):
    table = "\n[plugin.low_level_zero]\nstage = 2\n"
    return cai_figures(run_cai(build, args, work / f"zero-{index}", "low_level_zero", table))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build", type=Path, help="build directory with bin/cai and the plugins")
    add_job_options(p)
    p.add_argument("--strategy", default="FULL_SHARD", choices=("FULL_SHARD", "SHARD_GRAD_OP"))
    p.add_argument("--prefetch", action="store_true",
                   help="forward_prefetch and backward_prefetch = pre")
    args = p.parse_args()
    build = args.build.resolve()
    ratios = {k: [] for k in ("tok_ddp", "tok_zero", "tok_lz2", "rss_ddp", "rss_zero", "rss_lz2",
                              "dev_lz2")}
    print(f"{'pair':>4} {'fsdp tok/s':>10} {'ddp':>7} {'zero':>7} {'lz2':>7} "
          f"{'fsdp RSS MiB':>12} {'ddp':>7} {'zero':>7} {'lz2':>7} "
          f"{'fsdp dev MiB':>12} {'lz2':>6} {'all-gather B/rank':>20} {'reduce-scatter B/rank':>22}"
          f" {'3·4Ψ B':>9}")
    with tempfile.TemporaryDirectory(prefix="fsdp_bench_") as tmp:
        for i in range(args.pairs):
            fsdp = run_fsdp(build, args, Path(tmp), i)
            ddp = run_peer(args, peer_command(args, "ddp_gpt2_torch.py"))
            zero = run_peer(args, peer_command(args, "zero_gpt2_torch.py"))
            lz2 = run_zero2(build, args, Path(tmp), i)
            for name, peer in (("ddp", ddp), ("zero", zero), ("lz2", lz2)):
                ratios["tok_" + name].append(fsdp["tokens_per_s"] / peer["tokens_per_s"])
                ratios["rss_" + name].append(fsdp["peak_rss_bytes"] / peer["peak_rss_bytes"])
            ratios["dev_lz2"].append(fsdp["device_peak"] / lz2["device_peak"])
            mib = 2 ** 20
            # A collective's volume is its full buffer: an all-gather's output is N x its input.
            three_psi = 3 * 4 * ddp["params"]
            moved = 2 * fsdp["gathered"][0] + fsdp["reduced"][0]
            print(f"{i + 1:>4} {fsdp['tokens_per_s']:>10.0f} {ddp['tokens_per_s']:>7.0f} "
                  f"{zero['tokens_per_s']:>7.0f} {lz2['tokens_per_s']:>7.0f} "
                  f"{fsdp['peak_rss_bytes'] / mib:>12.1f} {ddp['peak_rss_bytes'] / mib:>7.1f} "
                  f"{zero['peak_rss_bytes'] / mib:>7.1f} {lz2['peak_rss_bytes'] / mib:>7.1f} "
                  f"{fsdp['device_peak'] / mib:>12.2f} {lz2['device_peak'] / mib:>6.2f} "
                  f"{str(fsdp['gathered']):>20} {str(fsdp['reduced']):>22} "
                  f"{three_psi:>9} (rank 0 moved {moved:.0f})", flush=True)
    print(f"BLAS (cai rank 0; the peers' torch loads the same libblas.so.3): {fsdp['blas']}")
    med = {k: statistics.median(v) for k, v in ratios.items()}
    print(f"median tokens/s ratio fsdp/torch DDP: {med['tok_ddp']:.3f} (target >= 0.8); "
          f"fsdp/torch ZeRO: {med['tok_zero']:.3f}; fsdp/low_level_zero stage 2: "
          f"{med['tok_lz2']:.3f}")
    print(f"median peak RSS ratio fsdp/torch DDP: {med['rss_ddp']:.3f}; fsdp/torch ZeRO: "
          f"{med['rss_zero']:.3f} (target < 1 for both); fsdp/low_level_zero stage 2: "
          f"{med['rss_lz2']:.3f}; pool device peak fsdp/low_level_zero stage 2: "
          f"{med['dev_lz2']:.3f}")


if __name__ == "__main__":
    main()
