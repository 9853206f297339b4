#!/usr/bin/env python3
"""The largest GPT-2 each strategy trains on this machine: two optimizer steps on N ranks,
sizes tried in increasing order until one fails (out of memory, or any other exit), the last
that ran being the strategy's largest.

Every run is confined to a memory cgroup (`--memory-cap`, v1 or v2, when /sys/fs/cgroup lets
us make one), so that the kernel's OOM killer ends the run, not the machine; without a
writable cgroup the script refuses unless --no-cgroup says to run unconfined.

Strategies: cai's by name with their --set keys (see STRATEGIES) and the PyTorch peers
torch-ddp (DistributedDataParallel) and torch-zero (DDP + ZeroRedundancyOptimizer). A row
reports Ψ, whether it ran, the largest rank's peak RSS, the cgroup's peak (all ranks and the
page cache they caused) and the wall time; the table goes to stdout and the JSON to --out.

  bench/scale_bench.py build --sizes 24x1152,36x2240 --strategies torch-ddp,gemini-nvme-bf16
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import benchlib

# cai strategies: plugin and --set keys. NVMe runs put their files under --nvme-dir.
STRATEGIES = {
    "gemini-nvme": ("gemini", [
        "model.init_device=lazy", "plugin.gemini.offload_optim_frac=1.0",
        "plugin.gemini.offload_param_frac=1.0", "plugin.gemini.nvme_offload_fraction=1.0",
        "plugin.gemini.nvme_offload_masters=true", "plugin.gemini.chunk_init_device=host"]),
    "fsdp-offload": ("fsdp", ["model.init_device=lazy", "plugin.fsdp.cpu_offload=true"]),
    "zero2-offload": ("low_level_zero", [
        "model.init_device=lazy", "plugin.low_level_zero.stage=2",
        "plugin.low_level_zero.cpu_offload=true"]),
    "ddp": ("ddp", []),
}
PEERS = {"torch-ddp": "ddp_gpt2_torch.py", "torch-zero": "zero_gpt2_torch.py"}


def psi(n_layer, n_embd, vocab, n_ctx):
    return 12 * n_layer * n_embd * n_embd + 13 * n_layer * n_embd + (vocab + n_ctx) * n_embd \
        + 2 * n_embd


class Cgroup:
    """A memory cgroup capped at `cap` bytes that each run's process joins before exec."""

    def __init__(self, cap, name="cai-scale-bench"):
        v1 = Path("/sys/fs/cgroup/memory")
        self.path = (v1 if v1.is_dir() else Path("/sys/fs/cgroup")) / name
        self.v1 = v1.is_dir()
        self.path.mkdir(exist_ok=True)
        limit = "memory.limit_in_bytes" if self.v1 else "memory.max"
        (self.path / limit).write_text(str(cap))

    def reset_peak(self):
        if self.v1:
            (self.path / "memory.max_usage_in_bytes").write_text("0")

    def peak(self):
        f = self.path / ("memory.max_usage_in_bytes" if self.v1 else "memory.peak")
        return int(f.read_text()) if f.exists() else None

    def join(self):
        (self.path / ("tasks" if self.v1 else "cgroup.procs")).write_text(str(os.getpid()))


def run(cmd, env, cgroup, timeout, log):
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=cgroup.join if cgroup else None,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            code = "timeout"
    return code, time.monotonic() - start


def one(args, name, size, cgroup, work):
    n_layer, n_embd = size
    head = next((d for d in (64, 80, 96, 112, 128) if n_embd % d == 0), None)
    if head is None:
        sys.exit(f"--sizes: n_embd {n_embd} is not a multiple of a head size 64, 80, 96, 112 "
                 "or 128")
    n_head = n_embd // head
    job = argparse.Namespace(kind="gpt2", vocab_size=args.vocab_size, n_ctx=args.seq_len,
                             n_layer=n_layer, n_head=n_head, n_kv_head=0, n_embd=n_embd,
                             steps=2, global_batch=args.global_batch, seq_len=args.seq_len,
                             precision="bf16" if name.endswith("-bf16") else "fp32",
                             nproc=args.nproc)
    tag = f"{name}-{n_layer}x{n_embd}"
    log = work / f"{tag}.log"
    if name in PEERS:
        cmd = benchlib.peer_command(job, PEERS[name])
        env = benchlib.environment()
    else:
        plugin, sets = STRATEGIES[name.removesuffix("-bf16")]
        run_dir = work / tag
        run_dir.mkdir(parents=True, exist_ok=True)
        job_file = run_dir.with_suffix(".toml")
        job_file.write_text(benchlib.JOB.format(**vars(job)))
        nvme = Path(args.nvme_dir) / tag
        nvme.mkdir(parents=True, exist_ok=True)
        cmd = [str(args.build / "bin" / "cai"), "train", str(job_file), "--nproc",
               str(args.nproc), "--run-dir", str(run_dir), "--set", f"plugin.name={plugin}",
               "--set", "model.activation_checkpointing=true", "--set", "data.eval_fraction=0",
               "--set", f"memory.nvme_dir={nvme}"]
        for s in sets:
            cmd += ["--set", s]
        env = dict(benchlib.environment(), CAI_PLUGIN_FILES=str(
            args.build / "lib" / "cai" / "plugins" / f"{plugin}.toml"))
    if cgroup:
        cgroup.reset_peak()
    code, wall = run(cmd, env, cgroup, args.timeout, log)
    row = {"strategy": name, "n_layer": n_layer, "n_embd": n_embd,
           "params": psi(n_layer, n_embd, args.vocab_size, args.seq_len), "exit": code,
           "wall_s": round(wall, 1), "cgroup_peak_bytes": cgroup.peak() if cgroup else None,
           "peak_rss_bytes": None, "log": str(log)}
    if code == 0:
        if name in PEERS:
            peer = json.loads(log.read_text().strip().splitlines()[-1])
            row["peak_rss_bytes"] = max(peer["peak_rss_bytes"])
            row["params"] = peer["params"]
        else:
            summary = json.loads((work / tag / "summary.json").read_text())
            row["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in summary["ranks"])
            row["blas"] = summary["blas"]
    if name not in PEERS:
        subprocess.run(["rm", "-rf", str(Path(args.nvme_dir) / tag)])
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("build", type=Path)
    p.add_argument("--sizes", required=True,
                   help="n_layer x n_embd, comma-separated, in increasing order (24x1152,...)")
    p.add_argument("--strategies", required=True,
                   help=f"of {', '.join(list(STRATEGIES) + list(PEERS))}; -bf16 trains a cai "
                   "strategy in bf16")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--global-batch", dest="global_batch", type=int, default=2)
    p.add_argument("--seq-len", dest="seq_len", type=int, default=128)
    p.add_argument("--vocab-size", dest="vocab_size", type=int, default=50304)
    p.add_argument("--memory-cap", dest="memory_cap", type=float, default=22.0,
                   help="GiB the runs may use together (a memory cgroup)")
    p.add_argument("--no-cgroup", dest="no_cgroup", action="store_true")
    p.add_argument("--nvme-dir", dest="nvme_dir", default="/tmp/cai-scale-nvme")
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--out", type=Path, default=Path("/tmp/cai-scale-bench"))
    args = p.parse_args()
    args.build = args.build.resolve()
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    names = args.strategies.split(",")
    for n in names:
        if n not in PEERS and n.removesuffix("-bf16") not in STRATEGIES:
            sys.exit(f"--strategies: unknown '{n}'; one of "
                     f"{', '.join(list(STRATEGIES) + list(PEERS))} (cai ones may end in -bf16)")
    cgroup = None
    if not args.no_cgroup:
        try:
            cgroup = Cgroup(int(args.memory_cap * 2**30))
        except OSError as e:
            sys.exit(f"cannot make a memory cgroup ({e}); run as root, or pass --no-cgroup "
                     "to run unconfined (an out-of-memory run may then take the machine)")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        for size in sizes:
            row = one(args, name, size, cgroup, args.out)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if row["exit"] != 0:
                break
    (args.out / "scale.json").write_text(json.dumps(rows, indent=1))
    print("\n| strategy | largest that ran (Ψ) | its peak RSS per rank | first that failed (Ψ) |")
    print("|---|---|---|---|")
    for name in names:
        ran = [r for r in rows if r["strategy"] == name and r["exit"] == 0]
        failed = [r for r in rows if r["strategy"] == name and r["exit"] != 0]
        best = ran[-1] if ran else None
        print(f"| {name} | {best['params'] / 1e6:.0f}M | {best['peak_rss_bytes'] / 2**30:.2f} GiB |"
              if best else f"| {name} | none |  - |", end="")
        print(f" {failed[0]['params'] / 1e6:.0f}M (exit {failed[0]['exit']}) |" if failed
              else " - (all ran) |")


if __name__ == "__main__":
    main()
