#!/usr/bin/python3
"""Activation memory per rank against sequence length under libcai_hybrid_parallel's sequence
parallelism (split_gather and ring over tp_size 2; all_to_all, DeepSpeed-Ulysses, and
ring_attn, ring attention, over sp_size 2), tensor parallelism alone (tp_size 2) and one rank,
and the longest sequence each would fit in a memory limit per rank, extrapolated.

Memory: LibTorch's peak over the training steps (summary.json framework_step_peak_bytes, the
largest rank's), which holds the activations and the step's temporaries; the parameters,
gradients and optimizer state live in the strategy's buffers and are reported apart. The
attention is the memory-efficient kernel (model.memory_efficient_attention), so nothing grows
as T²: what is left grows linearly with T, and sequence parallelism divides all of it by tp
(split_gather) or sp (all_to_all, whose attention holds every position for 1/sp of the heads;
ring_attn, whose attention holds this rank's positions of every head and one other rank's keys
and values at a time).

Longest sequence: the peak is a + b·T (fitted through the two longest lengths measured); the
T where it reaches --limit-gib per rank is extrapolated, not run (the attention's compute grows
as T², so a run at that length would take hours on this machine's two cores).

Longest sequence, measured (--longest-gib G): for each mode, the longest T (a multiple of
--longest-step) that trains the steps with memory.device_budget = G GiB per rank, which counts
everything a rank allocates (the pool's buffers, so parameters, gradients and optimizer state,
and LibTorch's activations and temporaries) and fails the run with an out-of-memory error past
it. Searched from the fit's prediction: up or down by a quarter until one length trains and
one fails, then bisected down to the step. G is kept small enough that the runs take minutes:
the limit above, extrapolated, is where the figures for a whole machine come from.

Speed (--speed-pairs N): two modes (--speed-modes, default tp 2 and tp 2 + split_gather)
alternating N times at T = --speed-len (global batch 8, 6 steps), tokens/s of each and the
per-pair ratio of the second to the first, median with min-max: e.g. what split_gather's
all-gathers, reduce-scatters and re-gather in backward cost against tensor parallelism's
all-reduces, or ring attention against Ulysses.

usage: bench/sequence_bench.py BUILD_DIR [--lengths 1024,2048,4096,8192] [--limit-gib 10]
                               [--longest-gib 1 [--longest-step 512]]
                               [--modes "1 rank,sp 2 all_to_all"] [--speed-pairs 5]
                               [--speed-modes "tp 2,tp 2 + split_gather"] [--speed-len 1024]
                               [job sizes of benchlib.py]
"""
import argparse
import sys
import tempfile
from pathlib import Path

from benchlib import add_job_options, format_spread, run_cai, spread, try_cai

MODES = {
    "1 rank": (1, ""),
    "tp 2": (2, "tp_size = 2\n"),
    "tp 2 + split_gather": (2, "tp_size = 2\nenable_sequence_parallelism = true\n"),
    "tp 2 + ring": (2, 'tp_size = 2\nenable_sequence_parallelism = true\n'
                       'sequence_parallelism_mode = "ring"\n'),
    "sp 2 all_to_all": (2, 'sp_size = 2\nenable_sequence_parallelism = true\n'
                           'sequence_parallelism_mode = "all_to_all"\n'),
    "sp 2 ring_attn": (2, 'sp_size = 2\nenable_sequence_parallelism = true\n'
                          'sequence_parallelism_mode = "ring_attn"\n'),
}


# Every run: the tiled attention, and no evaluation.
SETS = ("model.memory_efficient_attention=true", "data.eval_fraction=0")


def slug(mode):
    return mode.replace(" ", "_").replace("+", "")


def job(args, work, mode, t, prefix=""):
    """Sets args to `mode` at length t; returns the run's directory and plugin table."""
    nproc, table = MODES[mode]
    args.nproc = nproc
    args.seq_len = args.n_ctx = t
    return work / f"{prefix}{slug(mode)}-{t}", "\n[plugin.hybrid_parallel]\n" + table


def peak(build, args, work, mode, t):
    run_dir, table = job(args, work, mode, t)
    summary = run_cai(build, args, run_dir, "hybrid_parallel", table, sets=SETS)
    return max(r["framework_step_peak_bytes"] for r in summary["ranks"]), summary["blas"]


def trains(build, args, work, mode, t, budget):
    """summary.json when `mode` trains at length t under the device budget; None when it runs
    out of it. Any other failure ends the benchmark."""
    run_dir, table = job(args, work, mode, t, prefix="longest-")
    summary, cmd, done = try_cai(build, args, run_dir, "hybrid_parallel", table,
                                 sets=SETS + (f"memory.device_budget={budget}",))
    print(f"    {mode}: T = {t}: {'trained' if summary else 'out of the budget'}", flush=True)
    if summary is not None:
        return summary
    output = done.stdout + done.stderr
    if "on memory tier DEVICE" not in output:
        sys.exit(f"{' '.join(cmd)} failed (exit {done.returncode}) other than by running out of "
                 f"the device budget:\n{output[-4000:]}")
    return None


def longest(build, args, work, mode, budget, guess):
    """The longest multiple of args.longest_step that trains under `budget` bytes per rank, the
    shortest that does not and the longest's summary.json, searched from `guess`."""
    step = args.longest_step
    snap = lambda t: max(step, int(round(t / step)) * step)  # noqa: E731
    fits, fails, best = None, None, None
    t = snap(guess)
    while fits is None or fails is None:
        ran = trains(build, args, work, mode, t, budget)
        if ran:
            fits, best = t, ran
            if fails is None:
                t = max(snap(t * 1.25), t + step)
        else:
            fails = t
            if fits is None:
                if t == step:
                    return None, t, None
                t = min(snap(t * 0.8), t - step)
    while fails - fits > step:
        t = snap((fits + fails) / 2)
        if t in (fits, fails):
            t = fits + step
        ran = trains(build, args, work, mode, t, budget)
        if ran:
            fits, best = t, ran
        else:
            fails = t
    return fits, fails, best


def speed(build, args, work, first, second):
    args.seq_len = args.n_ctx = args.speed_len
    args.global_batch, args.steps = 8, 6
    print(f"\ntokens/s at T = {args.speed_len}, global batch 8, 6 steps, alternating:")
    ratios = []
    for i in range(args.speed_pairs):
        figures = {}
        for mode in (first, second):
            args.nproc = MODES[mode][0]
            run_dir = work / f"speed-{slug(mode)}-{i}"
            summary = run_cai(build, args, run_dir, "hybrid_parallel",
                              "\n[plugin.hybrid_parallel]\n" + MODES[mode][1], sets=SETS)
            figures[mode] = summary["tokens_per_s"]
        ratios.append(figures[second] / figures[first])
        print(f"  pair {i + 1}: {first} {figures[first]:.0f}, {second} {figures[second]:.0f}, "
              f"ratio {ratios[-1]:.3f}", flush=True)
    print(f"  {second} / {first} tokens/s: median {format_spread(spread(ratios))}; BLAS: "
          f"{summary['blas']}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build", type=Path)
    add_job_options(p, pairs=1)
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--limit-gib", dest="limit_gib", type=float, default=10.0)
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated, of: " + ", ".join(MODES))
    p.add_argument("--longest-gib", dest="longest_gib", type=float, default=0.0,
                   help="search each mode's longest T under this device budget per rank "
                        "(needs two --lengths for the first guess)")
    p.add_argument("--longest-step", dest="longest_step", type=int, default=512)
    p.add_argument("--speed-pairs", dest="speed_pairs", type=int, default=0)
    p.add_argument("--speed-modes", dest="speed_modes", default="tp 2,tp 2 + split_gather",
                   help="the two modes the speed pairs alternate, comma-separated")
    p.add_argument("--speed-len", dest="speed_len", type=int, default=1024)
    p.set_defaults(steps=2, global_batch=2, n_layer=2, n_embd=256, n_head=8, timeout=1800)
    args = p.parse_args()
    build = args.build.resolve()
    lengths = [int(t) for t in args.lengths.split(",") if t]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    speed_modes = [m.strip() for m in args.speed_modes.split(",") if m.strip()]
    if len(speed_modes) != 2 or any(m not in MODES for m in speed_modes):
        p.error(f"--speed-modes: two of {list(MODES)}, got {speed_modes}")
    mib = 2 ** 20
    blas = ""
    with tempfile.TemporaryDirectory(prefix="sequence_bench_") as tmp:
        before, last = {}, {}
        if lengths:
            print(f"GPT-2 n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head}, "
                  f"global batch {args.global_batch}, memory-efficient attention; LibTorch's "
                  f"peak over the steps per rank, MiB")
            print(f"{'T':>6} " + " ".join(f"{m:>20}" for m in modes) +
                  "".join(f" {m.split()[-1] + '/1 rank':>22}" for m in modes[1:]
                          if "1 rank" in modes))
        for t in lengths:
            row = {}
            for mode in modes:
                row[mode], blas = peak(build, args, Path(tmp), mode, t)
            print(f"{t:>6} " + " ".join(f"{row[m] / mib:>20.1f}" for m in modes) +
                  "".join(f" {row[m] / row['1 rank']:>22.3f}" for m in modes[1:]
                          if "1 rank" in modes), flush=True)
            before, last = last, row
        if lengths:
            print(f"BLAS: {blas}")
        if args.speed_pairs:
            speed(build, args, Path(tmp), *speed_modes)
        if len(lengths) < 2:
            if args.longest_gib:
                p.error("--longest-gib needs two --lengths to fit its first guess")
            return
        limit = args.limit_gib * 2 ** 30
        print(f"\nlongest sequence within {args.limit_gib:g} GiB of LibTorch's memory per rank "
              f"(a + b·T through T = {lengths[-2]} and {lengths[-1]}, extrapolated):")
        fit = {}  # mode: (b, a) of a + b·T
        for mode in modes:
            slope = (last[mode] - before[mode]) / (lengths[-1] - lengths[-2])
            base = last[mode] - slope * lengths[-1]
            fit[mode] = slope, base
            print(f"  {mode:>20}: {slope / 1024:.1f} KiB per token, T ≈ "
                  f"{int((limit - base) / slope):,}", flush=True)
        if not args.longest_gib:
            return
        budget = int(args.longest_gib * 2 ** 30)
        print(f"\nlongest sequence that trains {args.steps} steps under memory.device_budget = "
              f"{budget} B ({args.longest_gib:g} GiB) per rank, in steps of {args.longest_step}, "
              f"searched from the fit's prediction for LibTorch's memory alone:")
        found = {}
        for mode in modes:
            slope, base = fit[mode]
            found[mode] = longest(build, args, Path(tmp), mode, budget, (budget - base) / slope)
        print(f"\n{'mode':>20} {'longest T':>10} {'fails at':>9} {'device peak MiB':>16} "
              f"{'s/step':>7} {'/ 1 rank':>9}")
        for mode in modes:
            fits, fails, best = found[mode]
            if fits is None:
                print(f"{mode:>20} {'none':>10} {fails:>9}")
                continue
            summary = best
            device = max(r["device_total_peak_bytes"] for r in summary["ranks"])
            ratio = (f"{fits / found['1 rank'][0]:>9.2f}"
                     if found.get("1 rank", (None,))[0] else "")
            print(f"{mode:>20} {fits:>10} {fails:>9} {device / mib:>16.1f} "
                  f"{summary['median_step_time_s']:>7.1f} {ratio}", flush=True)


if __name__ == "__main__":
    main()
