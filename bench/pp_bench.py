#!/usr/bin/python3
"""libcai_hybrid_parallel's pipeline (pp_size 2, 1F1B) against a hand-written PyTorch 1F1B peer
(bench/peers/pp_gpt2_torch.py: the same GPT-2, stage split, micro-batches, AdamW and clipping
on Gloo isend/irecv) and against PyTorch's own Pipe (bench/peers/gpipe_gpt2_torch.py: GPipe,
single-process, two threads), and the pipeline bubble measured against its formula.

The protocol, job and runners of bench/benchlib.py; each figure is the median over pairs of
the per-pair ratio with its min-max range. Per run: tokens/s and the largest peak RSS of a rank.

Bubble: cai's plugin logs each pipeline rank's busy time (inside its stages' forward and
backward) over the time in execute_pipeline; 1 - busy/total is the measured bubble fraction,
compared with 1F1B's (p - 1)/(m + p - 1) and interleaved's (p - 1)/(v·m + p - 1) at
m = 4, 8, 16 (--bubble), and the zero-bubble V's with what its schedule simulates (the plugin
logs it: equal F, B and W times).

Zero-bubble V against 1F1B (--zbv-pairs N): N pairs of cai runs at the same pp and m, the two
schedules alternating which goes first; tokens/s ratio zbv/1f1b, peak RSS ratio, bubbles.

usage: bench/pp_bench.py BUILD_DIR [--pairs 5 (0: no peers)] [--steps 12] [--microbatches 8]
                         [job sizes of benchlib.py] [--bubble] [--zbv-pairs 5] [--pp 2]
"""
import argparse
import re
import tempfile
from pathlib import Path

from benchlib import (add_job_options, cai_figures, format_spread, peer_command, run_cai,
                      run_peer, spread)


ZBV = 'pp_style = "zbv"\nnum_model_chunks = 2\n'


def run_pipeline(build, args, work, index, m, extra=""):
    run_dir = work / f"cai-{index}"
    summary = run_cai(build, args, run_dir, "hybrid_parallel",
                      f"\n[plugin.hybrid_parallel]\npp_size = {args.nproc}\n{extra}",
                      sets=(f"train.grad_accum={m}",))
    bubbles, simulated = [], None
    for log in sorted((run_dir / "logs").glob("rank-*.log")):
        text = log.read_text()
        found = re.search(r"bubble fraction ([0-9.e-]+)", text)
        if found:
            bubbles.append(float(found.group(1)))
        found = re.search(r"zbv schedule takes .* \(bubble ([0-9.e-]+);", text)
        if found:
            simulated = float(found.group(1))
    return dict(cai_figures(summary), bubble=bubbles, simulated=simulated)


def rounded(values):
    return str([round(v, 3) for v in values])


def compare_zbv(build, args, work, m):
    """Alternating 1F1B and zero-bubble V runs at the same pp and m."""
    print(f"\nzbv against 1f1b, pp {args.nproc}, m {m}:")
    print(f"{'pair':>4} {'zbv tok/s':>10} {'1f1b':>7} {'ratio':>6} {'zbv RSS MiB':>11} "
          f"{'1f1b':>7} {'bubble zbv':>18} {'1f1b':>18}")
    tok, rss, bub_zbv, bub_1f1b = [], [], [], []
    for i in range(args.zbv_pairs):
        runs = {}
        for style in (("zbv", "1f1b") if i % 2 == 0 else ("1f1b", "zbv")):
            runs[style] = run_pipeline(build, args, work, f"zbv-pair-{i}-{style}", m,
                                       ZBV if style == "zbv" else "")
        z, o = runs["zbv"], runs["1f1b"]
        tok.append(z["tokens_per_s"] / o["tokens_per_s"])
        rss.append(z["peak_rss_bytes"] / o["peak_rss_bytes"])
        bub_zbv.append(max(z["bubble"]))
        bub_1f1b.append(max(o["bubble"]))
        print(f"{i + 1:>4} {z['tokens_per_s']:>10.0f} {o['tokens_per_s']:>7.0f} {tok[-1]:>6.3f} "
              f"{z['peak_rss_bytes'] / 2 ** 20:>11.1f} {o['peak_rss_bytes'] / 2 ** 20:>7.1f} "
              f"{rounded(z['bubble']):>18} {rounded(o['bubble']):>18}", flush=True)
    print(f"BLAS (cai rank 0): {z['blas']}")
    print(f"tokens/s zbv/1f1b: median {format_spread(spread(tok))}; peak RSS zbv/1f1b: median "
          f"{format_spread(spread(rss))}")
    print(f"largest rank bubble: zbv median {format_spread(spread(bub_zbv))}, 1f1b median "
          f"{format_spread(spread(bub_1f1b))}; zbv's schedule simulates {z['simulated']:.3f}, "
          f"1F1B's formula {(args.nproc - 1) / (m + args.nproc - 1):.3f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build", type=Path)
    add_job_options(p)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--bubble", action="store_true", help="also measure the bubble at m=4,8,16")
    p.add_argument("--zbv-pairs", dest="zbv_pairs", type=int, default=0,
                   help="alternating pairs of zbv and 1f1b runs at --microbatches")
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks (the job's nproc)")
    args = p.parse_args()
    args.nproc = args.pp
    build = args.build.resolve()
    m = args.microbatches
    tok, rss, tok_gpipe, rss_gpipe = [], [], [], []
    mib = 2 ** 20
    print(f"{'pair':>4} {'cai tok/s':>10} {'1f1b':>7} {'gpipe':>7} {'ratio':>6} {'ratio':>6} "
          f"{'cai RSS MiB':>11} {'1f1b':>7} {'gpipe':>7} {'bubble cai':>16} {'1f1b':>16}")
    with tempfile.TemporaryDirectory(prefix="pp_bench_") as tmp:
        for i in range(args.pairs):
            cai = run_pipeline(build, args, Path(tmp), i, m)
            cmd = peer_command(args, "pp_gpt2_torch.py") + ["--microbatches", str(m)]
            torch = run_peer(args, cmd)
            cmd = peer_command(args, "gpipe_gpt2_torch.py") + ["--microbatches", str(m)]
            gpipe = run_peer(args, cmd)
            tok.append(cai["tokens_per_s"] / torch["tokens_per_s"])
            rss.append(cai["peak_rss_bytes"] / torch["peak_rss_bytes"])
            tok_gpipe.append(cai["tokens_per_s"] / gpipe["tokens_per_s"])
            rss_gpipe.append(cai["peak_rss_bytes"] / gpipe["peak_rss_bytes"])
            peer_bubble = [round(1 - b, 3) for b in torch["busy_fraction"]]
            print(f"{i + 1:>4} {cai['tokens_per_s']:>10.0f} {torch['tokens_per_s']:>7.0f} "
                  f"{gpipe['tokens_per_s']:>7.0f} {tok[-1]:>6.3f} {tok_gpipe[-1]:>6.3f} "
                  f"{cai['peak_rss_bytes'] / mib:>11.1f} {torch['peak_rss_bytes'] / mib:>7.1f} "
                  f"{gpipe['peak_rss_bytes'] / mib:>7.1f} "
                  f"{str([round(b, 3) for b in cai['bubble']]):>16} {str(peer_bubble):>16}",
                  flush=True)
        if tok:
            print(f"BLAS (cai rank 0; the peer's torch loads the same libblas.so.3): "
                  f"{cai['blas']}")
            print(f"tokens/s cai/torch 1F1B: median {format_spread(spread(tok))} (target >= 1.2); "
                  f"peak RSS cai/torch 1F1B: median {format_spread(spread(rss))} (target <= 1)")
            print(f"tokens/s cai/torch GPipe (Pipe, 1 process, 2 threads): median "
                  f"{format_spread(spread(tok_gpipe))}; peak RSS cai/GPipe: median "
                  f"{format_spread(spread(rss_gpipe))}")
        if args.bubble:
            pp = args.nproc
            print(f"\n{'schedule':>12} {'m':>3} {'measured bubble (per rank)':>34} "
                  f"{'formula':>8}")
            for style, v in (("1f1b", 1), ("interleaved", 2), ("zbv", 2)):
                for mb in (4, 8, 16):
                    extra = (ZBV if style == "zbv" else
                             f'pp_style = "interleaved"\nnum_model_chunks = {v}\n' if v > 1
                             else "")
                    r = run_pipeline(build, args, Path(tmp), f"bubble-{style}-{mb}", mb, extra)
                    formula = r["simulated"] if style == "zbv" else (pp - 1) / (v * mb + pp - 1)
                    print(f"{style:>12} {mb:>3} {rounded(r['bubble']):>34} {formula:>8.3f}",
                          flush=True)
        if args.zbv_pairs:
            compare_zbv(build, args, Path(tmp), m)


if __name__ == "__main__":
    main()
