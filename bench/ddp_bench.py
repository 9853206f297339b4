#!/usr/bin/python3
"""libcai_ddp against PyTorch DistributedDataParallel on the same GPT-2 job, side by side.

Both run 2 ranks on this machine over Gloo with OMP_NUM_THREADS=1 per rank (cai: train.threads
= 1), alternating cai and peer runs so that load drifting on a shared machine hits both alike;
the figure is the median over pairs of the per-pair ratio. Reported per pair: tokens/s (global
tokens per step over the median step time after the first step, the same definition on both
sides) and the largest peak RSS of a rank; for cai also the bytes each rank handed to
all-reduce in a step against the model's gradient bytes 4Ψ (must be equal at fp32).

With --malloc-tunables both sides run under the same GLIBC_TUNABLES, raising glibc's mmap and
trim thresholds (64 MiB / 256 MiB) so that per-step activation buffers are reused instead of
being returned to the kernel and page-faulted back in every step.

usage: bench/ddp_bench.py BUILD_DIR [--pairs 3] [--steps 12] [--gradient-as-bucket-view]
                          [--malloc-tunables]
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TUNABLES = "glibc.malloc.mmap_threshold=67108864:glibc.malloc.trim_threshold=268435456"


def environment(args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if args.malloc_tunables:
        env["GLIBC_TUNABLES"] = TUNABLES
    return env

JOB = """
[model]
kind = "gpt2"
vocab_size = 256
n_ctx = {n_ctx}
n_layer = {n_layer}
n_head = {n_head}
n_embd = {n_embd}

[optimizer]
kind = "adamw"
lr = 0.001
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
max_grad_norm = 1.0
warmup_steps = 0

[train]
steps = {steps}
global_batch = {global_batch}
seq_len = {seq_len}
threads = 1
eval_every = 0
eval_batches = 1
log_every = 1000

[checkpoint]
at_end = false
"""


def run_cai(build, args, work, index, plugin, table):
    """Trains JOB plus `table` (the plugin's TOML table) with plugin `plugin` on 2 ranks;
    returns summary.json."""
    job = work / "job.toml"
    job.write_text(JOB.format(**vars(args)) + table)
    run_dir = work / f"cai-{index}"
    env = dict(environment(args),
               CAI_PLUGIN_FILES=str(build / "lib" / "cai" / "plugins" / f"{plugin}.toml"))
    subprocess.run([str(build / "bin" / "cai"), "train", str(job), "--nproc", "2", "--run-dir",
                    str(run_dir), "--set", f"plugin.name={plugin}"], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    return json.loads((run_dir / "summary.json").read_text())


def run_ddp(build, args, work, index):
    table = ("\n[plugin.ddp]\nbucket_cap_mb = 25\ngradient_as_bucket_view = "
             f"{str(args.gradient_as_bucket_view).lower()}\n")
    summary = run_cai(build, args, work, index, "ddp", table)
    ranks = summary["ranks"]
    return {"tokens_per_s": summary["tokens_per_s"],
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
            "all_reduce_bytes_per_step": [r["comm_bytes_per_step_mean"]["all_reduce"] for r in ranks],
            "param_bytes": summary["strategy_bytes_rank0"]["params"],
            "blas": summary["blas"]}


def run_group(cmd, env, timeout=300):
    """Runs cmd in a session of its own and returns its stdout; on a timeout kills the whole
    session (the peer's ranks are its grandchildren) and raises TimeoutExpired."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd, out, err)
    return out


def peer_command(args, script):
    """The peer's command line with the job's sizes."""
    return ["/usr/bin/python3", str(HERE / "peers" / script), "--nproc", "2",
            "--steps", str(args.steps), "--global-batch", str(args.global_batch),
            "--seq-len", str(args.seq_len), "--n-ctx", str(args.n_ctx),
            "--n-layer", str(args.n_layer), "--n-head", str(args.n_head),
            "--n-embd", str(args.n_embd)]


def run_peer_command(args, cmd):
    """Runs a peer; returns its JSON line with the largest rank's peak RSS.

    PyTorch 1.13's Gloo DDP now and then leaves one rank waiting forever in a collective after
    its peer exited (seen ~1 run in 10 on the loaded 2-core machine): such a run is killed and
    run again, and the retry is reported."""
    for attempt in range(3):
        try:
            out = run_group(cmd, environment(args))
            break
        except subprocess.TimeoutExpired:
            print(f"  peer run {attempt + 1} hung for 300 s; killed, running it again",
                  file=sys.stderr, flush=True)
    else:
        raise RuntimeError("the PyTorch peer hung three times in a row")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_bytes"] = max(result["peak_rss_bytes"])
    return result


def run_peer(args):
    cmd = peer_command(args, "ddp_gpt2_torch.py")
    if args.gradient_as_bucket_view:
        cmd.append("--gradient-as-bucket-view")
    return run_peer_command(args, cmd)


def add_job_options(p):
    """The job's sizes, shared with the peers' defaults."""
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--global-batch", dest="global_batch", type=int, default=16)
    p.add_argument("--seq-len", dest="seq_len", type=int, default=128)
    p.add_argument("--n-ctx", dest="n_ctx", type=int, default=128)
    p.add_argument("--n-layer", dest="n_layer", type=int, default=4)
    p.add_argument("--n-head", dest="n_head", type=int, default=4)
    p.add_argument("--n-embd", dest="n_embd", type=int, default=128)
    p.add_argument("--malloc-tunables", dest="malloc_tunables", action="store_true",
                   help="the same GLIBC_TUNABLES on both sides: " + TUNABLES)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build", type=Path, help="build directory with bin/cai and libcai_ddp")
    add_job_options(p)
    p.add_argument("--gradient-as-bucket-view", dest="gradient_as_bucket_view",
                   action="store_true", help="on both sides")
    args = p.parse_args()
    speed, rss = [], []
    print(f"{'pair':>4} {'cai tok/s':>10} {'torch tok/s':>11} {'ratio':>6} "
          f"{'cai RSS MiB':>11} {'torch RSS MiB':>13} {'ratio':>6} {'all-reduce B/step/rank':>24} "
          f"{'4Ψ B':>10}")
    with tempfile.TemporaryDirectory(prefix="ddp_bench_") as tmp:
        for i in range(args.pairs):
            cai = run_ddp(args.build.resolve(), args, Path(tmp), i)
            peer = run_peer(args)
            speed.append(cai["tokens_per_s"] / peer["tokens_per_s"])
            rss.append(cai["peak_rss_bytes"] / peer["peak_rss_bytes"])
            four_psi = 4 * peer["params"]
            print(f"{i + 1:>4} {cai['tokens_per_s']:>10.0f} {peer['tokens_per_s']:>11.0f} "
                  f"{speed[-1]:>6.3f} {cai['peak_rss_bytes'] / 2**20:>11.1f} "
                  f"{peer['peak_rss_bytes'] / 2**20:>13.1f} {rss[-1]:>6.3f} "
                  f"{str(cai['all_reduce_bytes_per_step']):>24} {four_psi:>10}", flush=True)
            if any(b != four_psi for b in cai["all_reduce_bytes_per_step"]):
                print("  all-reduce bytes differ from 4Ψ", file=sys.stderr)
    print(f"BLAS (cai rank 0, the peer's torch loads the same libblas.so.3): {cai['blas']}")
    print(f"median tokens/s ratio cai/torch: {statistics.median(speed):.3f}; "
          f"median peak RSS ratio cai/torch: {statistics.median(rss):.3f}")


if __name__ == "__main__":
    main()
