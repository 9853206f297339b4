"""What every benchmark of bench/ shares: the job file, running `cai train` and a PyTorch peer,
and the median with its min-max range.

The protocol all of them follow: N ranks on this machine over Gloo, OMP_NUM_THREADS=1 and one
compute thread per rank on both sides, runs of the compared programs one after another within a
pair so that load drifting on a shared machine hits all alike, figures as the median over pairs
of the per-pair ratio. tokens/s is global tokens per step over the median step time after the
first step on every side; peak RSS is the largest rank's (getrusage).
"""
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

JOB = """
[model]
kind = "{kind}"
vocab_size = {vocab_size}
n_ctx = {n_ctx}
n_layer = {n_layer}
n_head = {n_head}
n_kv_head = {n_kv_head}
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
precision = "{precision}"
threads = 1
eval_every = 0
eval_batches = 1
log_every = 1000

[checkpoint]
at_end = false
"""


def environment():
    return dict(os.environ, OMP_NUM_THREADS="1")


MODELS = ("gpt2", "llama")
PRECISIONS = ("fp32", "bf16")


def add_model_options(p, models=MODELS, precisions=PRECISIONS):
    """The job's ranks, steps, batch, model and precision, the same on cai's side and the
    peers' (default: a 4-layer GPT-2 of Ψ = 842,496 in fp32). A peer names the models and
    precisions it implements, so that it refuses any other by name."""
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--global-batch", dest="global_batch", type=int, default=16)
    p.add_argument("--seq-len", dest="seq_len", type=int, default=128)
    p.add_argument("--model", dest="kind", choices=models, default="gpt2")
    p.add_argument("--vocab-size", dest="vocab_size", type=int, default=256)
    p.add_argument("--n-ctx", dest="n_ctx", type=int, default=128)
    p.add_argument("--n-layer", dest="n_layer", type=int, default=4)
    p.add_argument("--n-head", dest="n_head", type=int, default=4)
    p.add_argument("--n-kv-head", dest="n_kv_head", type=int, default=0,
                   help="Llama's key/value heads (0: as many as --n-head)")
    p.add_argument("--n-embd", dest="n_embd", type=int, default=128)
    p.add_argument("--precision", choices=precisions, default="fp32")


def add_job_options(p, pairs=3):
    """add_model_options and the benchmark's own: pairs, the timeout of a run."""
    add_model_options(p)
    p.add_argument("--pairs", type=int, default=pairs)
    p.add_argument("--timeout", type=int, default=300,
                   help="seconds one run may take; a PyTorch peer past it is killed and rerun")


def run_cai(build, job, run_dir, plugin, table="", sets=()):
    """Trains `job` (add_job_options' namespace) plus `table` (TOML) with plugin `plugin` on
    job.nproc ranks into run_dir; returns summary.json. `sets` are further --set KEY=VALUE."""
    summary, cmd, done = try_cai(build, job, run_dir, plugin, table, sets)
    if summary is None:
        sys.exit(f"{' '.join(cmd)} failed (exit {done.returncode}):\n"
                 f"{(done.stdout + done.stderr)[-4000:]}")
    return summary


def try_cai(build, job, run_dir, plugin, table="", sets=()):
    """run_cai for a run that may fail: (summary.json or None, the command, its
    CompletedProcess)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    job_file = run_dir.with_suffix(".toml")
    job_file.write_text(JOB.format(**vars(job)) + table)
    env = dict(environment(),
               CAI_PLUGIN_FILES=str(build / "lib" / "cai" / "plugins" / f"{plugin}.toml"))
    cmd = [str(build / "bin" / "cai"), "train", str(job_file), "--nproc", str(job.nproc),
           "--run-dir", str(run_dir), "--set", f"plugin.name={plugin}"]
    for s in sets:
        cmd += ["--set", s]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=job.timeout)
    if done.returncode != 0:
        return None, cmd, done
    return json.loads((run_dir / "summary.json").read_text()), cmd, done


def cai_figures(summary):
    """The figures compared across strategies, from a summary.json. bytes_per_step: the most
    bytes one rank handed to collectives in a step (summary's comm_bytes_per_step_mean);
    overlap: the least share of its reductions' time a rank spent computing (overlap_ratio)."""
    ranks = summary["ranks"]
    return {"tokens_per_s": summary["tokens_per_s"],
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
            "device_peak": max(r["peak_bytes"]["device"] for r in ranks),
            "bytes_per_step": max(sum(r["comm_bytes_per_step_mean"].values()) for r in ranks),
            "overlap": min(r["overlap_ratio"] for r in ranks),
            "blas": summary["blas"]}


def run_group(cmd, env, timeout):
    """Runs cmd in a session of its own and returns its stdout; on a timeout kills the whole
    session (a peer's ranks are its grandchildren) and raises TimeoutExpired."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{err[-4000:]}")
    return out


def peer_command(job, script):
    """bench/peers/`script`'s command line with the job's sizes."""
    return ["/usr/bin/python3", str(HERE / "peers" / script), "--nproc", str(job.nproc),
            "--steps", str(job.steps), "--global-batch", str(job.global_batch),
            "--seq-len", str(job.seq_len), "--model", job.kind,
            "--vocab-size", str(job.vocab_size), "--n-ctx", str(job.n_ctx),
            "--n-layer", str(job.n_layer), "--n-head", str(job.n_head),
            "--n-kv-head", str(job.n_kv_head), "--n-embd", str(job.n_embd),
            "--precision", job.precision]


def run_peer(job, cmd):
    """Runs a peer; returns its JSON line with peak_rss_bytes the largest rank's and reruns,
    the hung runs killed before it.

    PyTorch 1.13's Gloo DDP now and then leaves one rank waiting forever in a collective after
    its peer exited (seen ~1 run in 10 on the loaded 2-core machine): such a run is killed and
    run again, and the retry is reported."""
    for attempt in range(3):
        try:
            out = run_group(cmd, environment(), job.timeout)
            break
        except subprocess.TimeoutExpired:
            print(f"  peer run {attempt + 1} hung for {job.timeout} s; killed, running it again",
                  file=sys.stderr, flush=True)
    else:
        sys.exit(f"the PyTorch peer hung three times in a row: {' '.join(cmd)}")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_bytes"] = max(result["peak_rss_bytes"])
    result["reruns"] = attempt
    return result


def spread(values):
    """{"median", "min", "max"} of values."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def format_spread(s, digits=3):
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"
