#!/usr/bin/env python3
"""Two builds of cai on one job, alternating: what a host change costs or saves, per strategy.

Each pair runs the strategy once with each build (the order alternating from pair to pair), 2
ranks, and compares tokens/s and the largest rank's peak RSS from summary.json; the last lines
give each strategy's median new/old ratio with its min-max. The old build is typically a copy
of build/bin and build/lib taken before the change (its libraries are found through
LD_LIBRARY_PATH, as the copy's RUNPATH still names the original tree).

  cp -a build/bin build/lib /tmp/old/   # before the change; then rebuild build/
  bench/ab_builds.py /tmp/old build --size gpt2-30m --strategies ddp,fsdp,gemini --pairs 5
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# The jobs as measured: fp32 AdamW, one compute thread per rank, no evaluation or checkpoint.
JOBS = {
    "gpt2-tiny": dict(vocab_size=256, n_ctx=128, n_layer=4, n_head=4, n_embd=128, steps=30,
                      global_batch=16, seq_len=128),
    "gpt2-30m": dict(vocab_size=50304, n_ctx=256, n_layer=6, n_head=6, n_embd=384, steps=8,
                     global_batch=8, seq_len=256),
}
JOB = """[model]
kind = "gpt2"
vocab_size = {vocab_size}
n_ctx = {n_ctx}
n_layer = {n_layer}
n_head = {n_head}
n_embd = {n_embd}

[optimizer]
kind = "adamw"
lr = 0.001

[train]
steps = {steps}
global_batch = {global_batch}
seq_len = {seq_len}
threads = 1
eval_every = 0
log_every = 1000

[checkpoint]
at_end = false
"""


def run(build, strategy, job, run_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               CAI_PLUGIN_FILES=str(build / "lib" / "cai" / "plugins" / f"{strategy}.toml"),
               LD_LIBRARY_PATH=str(build / "lib"))
    r = subprocess.run([str(build / "bin" / "cai"), "train", str(job), "--nproc", "2",
                        "--run-dir", str(run_dir), "--set", f"plugin.name={strategy}"],
                       env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{build}: {strategy} failed (exit {r.returncode}):\n{r.stdout[-2000:]}"
                 f"{r.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary["tokens_per_s"], max(rank["peak_rss_bytes"] for rank in summary["ranks"])


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--size", choices=sorted(JOBS), default="gpt2-30m")
    p.add_argument("--strategies", default="ddp")
    p.add_argument("--pairs", type=int, default=5)
    args = p.parse_args()
    builds = {"old": args.old.resolve(), "new": args.new.resolve()}
    for name, build in builds.items():
        if not (build / "bin" / "cai").is_file():
            sys.exit(f"{name} build {build}: no bin/cai there")
    with tempfile.TemporaryDirectory(prefix="cai-ab-") as tmp:
        job = Path(tmp) / "job.toml"
        job.write_text(JOB.format(**JOBS[args.size]))
        results = {}
        for pair in range(args.pairs):
            for strategy in args.strategies.split(","):
                for name in (["old", "new"] if pair % 2 == 0 else ["new", "old"]):
                    results.setdefault((strategy, name), []).append(
                        run(builds[name], strategy, job, Path(tmp) / f"{strategy}-{name}-{pair}"))
                o, n = results[(strategy, "old")][-1], results[(strategy, "new")][-1]
                print(f"pair {pair} {strategy}: old {o[0]:.0f} tok/s {o[1] / 1e6:.0f} MB  new "
                      f"{n[0]:.0f} tok/s {n[1] / 1e6:.0f} MB  ratio {n[0] / o[0]:.3f}", flush=True)
    for strategy in args.strategies.split(","):
        pairs = list(zip(results[(strategy, "old")], results[(strategy, "new")]))
        speed = [n[0] / o[0] for o, n in pairs]
        rss = [n[1] / o[1] for o, n in pairs]
        print(f"{strategy}: tokens/s new/old median {statistics.median(speed):.3f} (min "
              f"{min(speed):.3f} max {max(speed):.3f}); peak RSS new/old median "
              f"{statistics.median(rss):.3f} (min {min(rss):.3f} max {max(rss):.3f})")


if __name__ == "__main__":
    main()
