#!/usr/bin/python3
"""cai's data-parallel strategies against their PyTorch peers on one job.

Each pair runs every candidate once and, right after a candidate, its peer if that peer has not
run yet in the pair; the candidates start in a rotated order in each pair, so that neither
place in the sequence nor load drifting on a shared machine favours one. The figures per
candidate are the median over pairs of the per-pair ratio against its reference, with the
min-max range, and its absolute tokens/s, peak RSS (largest rank) and the bytes one rank hands
to collectives per step: cai's from summary.json (comm_bytes_per_step_mean), the peers'
analytic (they count nothing).

References: ddp -> torch-ddp (DistributedDataParallel); zero1, zero2, zero2-offload, fsdp ->
torch-zero (DDP + ZeroRedundancyOptimizer: PyTorch 1.13's FullyShardedDataParallel needs CUDA);
tp2 -> torch-tp (Megatron-LM's f/g written by hand: 1.13 has no tensor-parallel API);
sp2 -> torch-ulysses (DeepSpeed-Ulysses' all-to-alls written over all_to_all_single).
torch-ddp and torch-zero train GPT-2 or Llama in fp32 or bf16 (autocast); torch-tp and
torch-ulysses GPT-2 in fp32 only. A strategy whose peer cannot run the job is compared with the
first of --strategies instead, and the report says so.

With --baseline OTHER_BUILD (a build of the commit before a change, say) every strategy also
runs on that build in every pair, right before or after its run on BUILD_DIR (which goes first
alternates by pair), and is compared with it: the figures of a change, before and after.
With --section TEXT the run gets a README section of its own named by TEXT, beside the job's.

Writes OUT/results.json (the job, the machine, every run's raw figures, the summary) and
OUT/plot.svg (gnuplot); --write-readme, or --readme RESULTS.json alone, regenerates the section
of bench/README.md between its run.py markers.

usage: bench/run.py BUILD_DIR [--size gpt2-30m] [--strategies ddp,zero2] [--peers torch-ddp]
                    [--precision fp32|bf16] [--pairs 5] [--steps 12] [--out DIR]
                    [--n-layer N --n-embd N ...] [--baseline OTHER_BUILD
                    [--baseline-label TEXT]] [--section TEXT] [--write-readme]
       bench/run.py --readme RESULTS.json
"""
import argparse
import collections
import datetime
import difflib
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib

STRATEGIES = {  # name: (plugin, its [plugin.<name>] table, PyTorch peer)
    "ddp": ("ddp", "", "torch-ddp"),
    "zero1": ("low_level_zero", "stage = 1\n", "torch-zero"),
    "zero2": ("low_level_zero", "stage = 2\n", "torch-zero"),
    "zero2-offload": ("low_level_zero", "stage = 2\ncpu_offload = true\n", "torch-zero"),
    "fsdp": ("fsdp", 'sharding_strategy = "FULL_SHARD"\n', "torch-zero"),
    # Gemini with every chunk on the device; with every chunk's state and parameters on the
    # host; with the state (masters, gradients, optimizer state) on the host; with the
    # optimizer state and masters on NVMe (the gradient shard and the compute copy stay in RAM,
    # as in gemini-host: the two differ by what NVMe takes out of RAM, 12Ψ/N with Adam).
    "gemini": ("gemini", 'placement_policy = "static"\n', "torch-zero"),
    "gemini-offload": ("gemini", "offload_optim_frac = 1.0\noffload_param_frac = 1.0\n",
                       "torch-zero"),
    "gemini-host": ("gemini", "offload_optim_frac = 1.0\n", "torch-zero"),
    "gemini-nvme": ("gemini", "offload_optim_frac = 1.0\nnvme_offload_fraction = 1.0\n"
                    "nvme_offload_masters = true\n", "torch-zero"),
    # Megatron-LM tensor parallelism over both ranks (hybrid_parallel, tp_size 2: no data
    # parallelism, every rank runs the whole global batch on half of each block).
    "tp2": ("hybrid_parallel", "tp_size = 2\n", "torch-tp"),
    # DeepSpeed-Ulysses over both ranks (hybrid_parallel, sp_size 2: every rank runs the whole
    # global batch on half of each sequence, attention on all of it for half of the heads).
    "sp2": ("hybrid_parallel", 'sp_size = 2\nenable_sequence_parallelism = true\n'
            'sequence_parallelism_mode = "all_to_all"\n', "torch-ulysses"),
    # The reduce-scatter waited for in backward (before/after async_reduce_scatter).
    "fsdp-sync-rs": ("fsdp", 'sharding_strategy = "FULL_SHARD"\nasync_reduce_scatter = false\n',
                     "torch-zero"),
}

def megatron_bytes(job, psi):
    """fp32 bytes of Megatron's f/g all-reduces per step: (4L + 2)·B·T·e, and 3·B·T for the
    distributed cross-entropy."""
    tokens = job.global_batch * job.seq_len
    return 4 * ((4 * job.n_layer + 2) * tokens * job.n_embd + 3 * tokens)


def ulysses_bytes(job, psi):
    """fp32 bytes of Ulysses' all-to-alls per step on 2 ranks, 4·B·(T/2)·2e per block (q, k, v
    packed and the output, each way), and DDP's all-reduce of the 4Ψ gradient bytes."""
    return 4 * (4 * job.global_batch * job.seq_len // 2 * 2 * job.n_embd * job.n_layer) + 4 * psi


# name: script in bench/peers, bytes one rank hands to collectives per step as a function of
# the job and Ψ, how, and the models and precisions the script implements. Bytes are counted as
# cai counts them: a collective's whole buffer; under bf16 autocast PyTorch's gradients and
# parameters stay fp32, so its bytes do not change with the precision.
Peer = collections.namedtuple("Peer", "script bytes_per_step how models precisions")
GPT2_FP32 = dict(models=("gpt2",), precisions=("fp32",))
EVERY_JOB = dict(models=benchlib.MODELS, precisions=benchlib.PRECISIONS)
PEERS = {
    "torch-ddp": Peer("ddp_gpt2_torch.py", lambda job, psi: 4 * psi,
                      "all-reduce of the gradients, 4Ψ", **EVERY_JOB),
    "torch-zero": Peer("zero_gpt2_torch.py", lambda job, psi: 8 * psi,
                       "all-reduce of the gradients 4Ψ + broadcast of every parameter from its "
                       "owner 4Ψ", **EVERY_JOB),
    "torch-tp": Peer("tp_gpt2_torch.py", megatron_bytes,
                     "Megatron's f/g all-reduces, 4·((4L + 2)·B·T·e + 3·B·T) for the global "
                     "batch", **GPT2_FP32),
    "torch-ulysses": Peer("ulysses_gpt2_torch.py", ulysses_bytes,
                          "Ulysses' all-to-alls 4·4·B·(T/2)·2e·L for the global batch and DDP's "
                          "4Ψ gradient all-reduce", **GPT2_FP32),
}


def why_peer_cannot(name, job):
    """Why PyTorch peer `name` cannot run `job`, or None."""
    peer = PEERS[name]
    why = []
    if job.kind not in peer.models:
        why.append(f"{name} implements {', '.join(peer.models)} only, not {job.kind}")
    if job.precision not in peer.precisions:
        why.append(f"{name} trains in {', '.join(peer.precisions)} only, not {job.precision}")
    return "; ".join(why) or None


# Global batch x seq_len is the same 2048 tokens a step for the larger sizes: enough work per
# step for 2 ranks without exhausting a small machine's memory at 124M parameters. Timeouts are
# about five times a run of 12 steps on 2 vCPUs: a hung PyTorch peer (benchlib.run_peer) costs
# no more than that before it is rerun.
SIZES = {
    "gpt2-tiny": dict(kind="gpt2", vocab_size=256, n_ctx=128, n_layer=4, n_head=4, n_kv_head=0,
                      n_embd=128, global_batch=16, seq_len=128, timeout=300),
    # GPT-2's vocabulary makes 6 x 384 the ~30M model (Ψ = 30,062,592).
    "gpt2-30m": dict(kind="gpt2", vocab_size=50304, n_ctx=256, n_layer=6, n_head=6, n_kv_head=0,
                     n_embd=384, global_batch=8, seq_len=256, timeout=300),
    "gpt2-124m": dict(kind="gpt2", vocab_size=50304, n_ctx=1024, n_layer=12, n_head=12,
                      n_kv_head=0, n_embd=768, global_batch=8, seq_len=256, timeout=900),
    # A ~30M GPT-2 whose blocks hold most of it (vocabulary 8192; Ψ = 29,627,392), for device
    # budgets: with GPT-2's vocabulary the logits alone outgrow a quarter of the model states.
    "gpt2-30m-v8k": dict(kind="gpt2", vocab_size=8192, n_ctx=256, n_layer=8, n_head=8,
                         n_kv_head=0, n_embd=512, global_batch=8, seq_len=256, timeout=600),
    # Grouped-query attention with 3 query heads per key/value head; Ψ = 99,496,704.
    "llama-100m": dict(kind="llama", vocab_size=32000, n_ctx=256, n_layer=8, n_head=12,
                       n_kv_head=4, n_embd=768, global_batch=8, seq_len=256, timeout=900),
}

README = benchlib.HERE / "README.md"
# Each job (size and precision) has a section of its own between its markers; a job without
# one gets a new section where NEW stands.
NEW = "<!-- run.py:new -->"


def section(result):
    """The job a README section is about: size and precision, the plugin keys a sweep of
    variants set and the baseline build a change is compared with (so that neither replaces
    the job's own section)."""
    swept = variants(result["strategies"])
    baseline = result.get("baseline")
    label = result.get("section")
    return (f"{result['size']} {result['job']['precision']}" +
            (f" sweep of {','.join(swept)}" if swept else "") +
            (f" against {baseline['label']}" if baseline else "") +
            (f" ({label})" if label else ""))


def markers(result):
    key = section(result)
    return f"<!-- run.py:begin {key} -->", f"<!-- run.py:end {key} -->"


MIB = 2 ** 20


def params(job):
    """Ψ of cai's zoo model (host/src/model/zoo.cpp): GPT-2 with biases, learned positions and
    the head tied to the token embedding; Llama without biases, untied head, SwiGLU of Meta's
    hidden size."""
    e, v, layers = job.n_embd, job.vocab_size, job.n_layer
    if job.kind == "gpt2":
        return v * e + job.n_ctx * e + layers * (12 * e * e + 13 * e) + 2 * e
    kv = (job.n_kv_head or job.n_head) * (e // job.n_head)
    ffn = 256 * ((8 * e // 3 + 255) // 256)
    return 2 * v * e + layers * (2 * e * e + 2 * kv * e + 3 * ffn * e + 2 * e) + e


def shapes(job):
    """The matmul widths of the model (bench/sgemm_peak.py's arguments)."""
    e = job.n_embd
    if job.kind == "gpt2":
        return {"ffn": 4 * e, "qkv": 3 * e}
    kv = (job.n_kv_head or job.n_head) * (e // job.n_head)
    return {"ffn": 256 * ((8 * e // 3 + 255) // 256), "qkv": e + 2 * kv}


FLOPS_FORMULA = "6·(Ψ − looked-up tables) + 12·layers·d·T"


def flops_per_token(job, psi):
    """Training FLOPs per token: 6 per parameter that a matrix product reads, forward and
    backward, plus attention's 12·layers·d·T (PaLM's appendix B). The tables only looked up
    are left out of Ψ: GPT-2's positions (its token embedding is also the head's matrix) and
    Llama's token embedding (its head is a matrix of its own); counting them put Llama's MFU
    above 100% of the sgemm peak. cai train counts the same (MatmulParams in
    host/src/train/console.h)."""
    lookups = job.n_ctx * job.n_embd if job.kind == "gpt2" else job.vocab_size * job.n_embd
    return 6 * (psi - lookups) + 12 * job.n_layer * job.n_embd * job.seq_len


def sgemm_peak(job):
    """bench/sgemm_peak.py for the model's shapes at one rank's micro-batch, in the run's
    precision (one thread, as each rank computes): GFLOP/s per shape and their maximum."""
    tokens = job.global_batch // job.nproc * job.seq_len
    w = shapes(job)
    cmd = ["/usr/bin/python3", str(benchlib.HERE / "sgemm_peak.py"), "--tokens", str(tokens),
           "--n-embd", str(job.n_embd), "--ffn", str(w["ffn"]), "--qkv", str(w["qkv"]),
           "--vocab", str(job.vocab_size), "--dtype", job.precision]
    out = subprocess.run(cmd, env=benchlib.environment(), check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


BASELINE = "@baseline"


def on_baseline(name):
    """(the strategy, whether this run of it is on --baseline's build) of a run's name."""
    return (name[:-len(BASELINE)], True) if name.endswith(BASELINE) else (name, False)


def strategy(name):
    """(plugin, its [plugin.<name>] table, PyTorch peer) of a strategy: one of STRATEGIES, or a
    variant of one with keys set, BASE:key=value[:key=value...]: a plain key is the plugin's
    (ddp:bucket_cap_mb=100), a dotted one the job's (ddp:train.cpu_caching_allocator=false);
    cai validates both like any job's keys."""
    base, *sets = name.split(":")
    plugin, options, peer = STRATEGIES[base]
    for kv in sets:
        key, value = kv.split("=", 1)
        if "." not in key:
            options += f"{key.strip()} = {value.strip()}\n"
    return plugin, options, peer


def job_sets(name):
    """The --set KEY=VALUE arguments of a variant's dotted (job) keys."""
    return [kv.strip() for kv in name.split(":")[1:] if "." in kv.split("=", 1)[0]]


def is_strategy(name):
    base, *sets = name.split(":")
    return base in STRATEGIES and all(
        "=" in kv and kv.split("=", 1)[0].strip() and kv.split("=", 1)[1].strip() for kv in sets)


def variants(strategies):
    """The plugin keys the strategies set beyond their base (sorted), e.g. ['bucket_cap_mb']."""
    return sorted({kv.split("=", 1)[0].strip() for s in strategies for kv in s.split(":")[1:]})


def names(text, valid, what):
    """The comma-separated names of text, each checked against valid."""
    chosen = [n for n in text.split(",") if n]
    for n in chosen:
        if n not in valid and not (valid is STRATEGIES and is_strategy(n)):
            near = difflib.get_close_matches(n.split(":")[0], valid, 1)
            hint = f" did you mean '{near[0]}'?" if near else ""
            if valid is STRATEGIES and ":" in n:
                hint += " (a variant is BASE:key=value[:key=value...])"
            sys.exit(f"run.py: unknown {what} '{n}'.{hint} valid: {', '.join(valid)}")
    return chosen


def parse_args(argv):
    sizes = argparse.ArgumentParser(add_help=False)
    sizes.add_argument("--size", default="gpt2-30m")
    size = sizes.parse_known_args(argv)[0].size
    names(size, SIZES, "size")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[sizes],
                                epilog="sizes: " + ", ".join(SIZES))
    p.add_argument("build", type=Path, nargs="?", help="build directory with bin/cai and plugins")
    benchlib.add_job_options(p, pairs=5)
    p.add_argument("--strategies", default="ddp,zero1,zero2,zero2-offload,fsdp",
                   help="comma-separated, of " + ", ".join(STRATEGIES) +
                   ", each optionally with plugin keys set: BASE:key=value[:key=value...]")
    p.add_argument("--peers", help="comma-separated, of " + ", ".join(PEERS) +
                   ", or none (default: the strategies' peers when they can run the job)")
    p.add_argument("--baseline", type=Path, metavar="OTHER_BUILD",
                   help="a second build directory: each strategy also runs on it, next to its "
                   "run on BUILD_DIR in every pair, and is compared with that run; no PyTorch "
                   "peer runs unless --peers names one")
    p.add_argument("--baseline-label", metavar="TEXT",
                   help="what the baseline build is, for the report (default: its directory)")
    p.add_argument("--section", metavar="TEXT",
                   help="give the run a README section of its own, named by TEXT (e.g. some "
                   "strategies rerun after a change), so that it does not replace the job's")
    p.add_argument("--out", type=Path, default=benchlib.HERE / "results",
                   help="where results.json and plot.svg go")
    p.add_argument("--write-readme", action="store_true",
                   help="regenerate bench/README.md's section from this run's results.json")
    p.add_argument("--readme", type=Path, metavar="RESULTS.json",
                   help="only regenerate bench/README.md's section from RESULTS.json")
    p.set_defaults(**SIZES[size])
    args = p.parse_args(argv)
    if args.readme is None and args.build is None:
        p.error("BUILD_DIR is needed unless --readme RESULTS.json is given")
    if args.pairs < 1:
        p.error("--pairs must be at least 1")
    if args.baseline_label and not args.baseline:
        p.error("--baseline-label needs --baseline")
    if args.baseline:
        args.baseline_label = args.baseline_label or args.baseline.resolve().name
    return args


def plan(args):
    """(strategies, peers, reference of each strategy, notes) for the job of args."""
    strategies = names(args.strategies, STRATEGIES, "strategy")
    if not strategies:
        sys.exit("run.py: --strategies names none; valid: " + ", ".join(STRATEGIES))
    notes = []
    baseline = getattr(args, "baseline", None)
    named = "none" if baseline and args.peers is None else args.peers
    if named is None:
        cannot = {p: why_peer_cannot(p, args) for p in dict.fromkeys(strategy(s)[2]
                                                                     for s in strategies)}
        peers = [p for p, why in cannot.items() if why is None]
        why_not = [why for why in cannot.values() if why]
    elif named == "none":
        peers, why_not = [], []
    else:
        peers, why_not = names(named, PEERS, "peer"), []
        refused = [why for why in (why_peer_cannot(p, args) for p in peers) if why]
        if refused:
            sys.exit(f"run.py: a PyTorch peer named by --peers cannot run this job "
                     f"({'; '.join(refused)}); leave it out")
    refs = {}
    for s in strategies:
        peer, base = strategy(s)[2], s.split(":")[0]
        # Without its peer a variant is compared with its base strategy where that ran too.
        fallback = base if base != s and base in strategies else strategies[0]
        refs[s] = peer if peer in peers else (fallback if s != fallback else None)
        if baseline:
            refs[s] = s + BASELINE
    if baseline:
        notes.append(f"Each strategy is compared with itself run on the baseline build "
                     f"({args.baseline_label}, the rows named {BASELINE}) in the same pair; "
                     f"which of the two ran first alternates by pair.")
    elif why_not:
        notes.append(f"Not run: {'; '.join(why_not)}. The strategies they match are compared "
                     f"with cai's {strategies[0]} (a variant's with its base where that ran).")
    else:
        unpaired = [s for s in strategies if refs[s] in strategies]
        if unpaired:
            notes.append(f"{', '.join(f'{s} compared with {refs[s]}' for s in unpaired)}: "
                         "--peers left out their PyTorch peer.")
    if args.precision == "bf16" and peers:
        notes.append("bf16: cai's strategies compute in bf16 over fp32 master weights (their "
                     "measured bytes/step show what they communicate in); the PyTorch peers "
                     "train under torch.autocast(\"cpu\", torch.bfloat16), PyTorch's mixed "
                     "precision, with fp32 weights, gradients and optimizer state, so DDP "
                     "reduces fp32 gradients (Gloo in 1.13 cannot reduce bf16).")
    if "zero2-offload" in strategies:
        notes.append("zero2-offload: over Gloo on the CPU the device and host tiers are the same "
                     "memory, so its RSS cannot drop; the row shows what the offload path costs.")
    if "fsdp" in strategies and refs["fsdp"] == "torch-zero":
        notes.append("fsdp is compared with torch-zero: PyTorch 1.13's FullyShardedDataParallel "
                     "refuses to run without CUDA.")
    for p in peers:
        notes.append(f"{p}'s bytes/step are analytic: {PEERS[p].how}.")
    return strategies, peers, refs, notes


def run_candidate(build, args, work, pair, name):
    base = on_baseline(name)[0]
    plugin, options, _ = strategy(base)
    table = f"\n[plugin.{plugin}]\n{options}"
    run_dir = work / f"pair{pair + 1}-{name.replace(':', '-').replace('=', '-')}"
    summary = benchlib.run_cai(build, args, run_dir, plugin, table, job_sets(base))
    figures = benchlib.cai_figures(summary)
    return dict(figures, side="cai", bytes_basis="measured", raw=summary)


def run_peer(args, name):
    peer = PEERS[name]
    result = benchlib.run_peer(args, benchlib.peer_command(args, peer.script))
    return {"side": "peer", "tokens_per_s": result["tokens_per_s"],
            "peak_rss_bytes": result["peak_rss_bytes"],
            "bytes_per_step": peer.bytes_per_step(args, result["params"]),
            "bytes_basis": "analytic: " + peer.how,
            "raw": result}


def pair_order(pair, strategies, peers, refs):
    """The runs of one pair: candidates rotated by the pair's index, each matching peer right
    after its first candidate, peers that match none last; a candidate compared with its run on
    the baseline build goes right before that run in even pairs and right after it in odd ones."""
    k = pair % len(strategies)
    order = []
    for s in strategies[k:] + strategies[:k]:
        if refs[s] == s + BASELINE:
            order += [s, refs[s]] if pair % 2 == 0 else [refs[s], s]
            continue
        order.append(s)
        if refs[s] in peers and refs[s] not in order:
            order.append(refs[s])
    return order + [p for p in peers if p not in order]


def summarize(runs, strategies, peers, refs):
    """One row per strategy and peer: median (min-max) over pairs of its figures and of its
    per-pair ratios against its reference."""
    by_pair = {}
    for r in runs:
        by_pair.setdefault(r["pair"], {})[r["name"]] = r
    rows = []
    for name in strategies + peers:
        mine = [p[name] for p in by_pair.values()]
        row = {"name": name, "side": mine[0]["side"], "reference": refs.get(name),
               "tokens_per_s": benchlib.spread([r["tokens_per_s"] for r in mine]),
               "peak_rss_mib": benchlib.spread([r["peak_rss_bytes"] / MIB for r in mine]),
               "bytes_per_step": benchlib.spread([r["bytes_per_step"] for r in mine]),
               "mfu": benchlib.spread([r["mfu"] for r in mine]),
               "overlap": (benchlib.spread([r["overlap"] for r in mine])
                           if mine[0]["side"] == "cai" else None),
               "bytes_basis": mine[0]["bytes_basis"]}
        if row["reference"]:
            ref = [p[row["reference"]] for p in by_pair.values()]
            row["ratio_tokens_per_s"] = benchlib.spread(
                [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(mine, ref)])
            row["ratio_peak_rss"] = benchlib.spread(
                [a["peak_rss_bytes"] / b["peak_rss_bytes"] for a, b in zip(mine, ref)])
        rows.append(row)
    return rows


def machine():
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    os_name = next((line.split("=", 1)[1].strip('"') for line in
                    Path("/etc/os-release").read_text().splitlines()
                    if line.startswith("PRETTY_NAME=")), platform.platform())
    return {"nproc": os.cpu_count(), "cpu": model, "os": os_name}


def table(result):
    """The summary as text: the run's printout and the README's block."""
    head = ("run", "vs", "tokens/s (min-max)", "ratio (min-max)", "peak RSS MiB (min-max)",
            "ratio (min-max)", "MFU", "overlap", "B/step/rank", "")
    rows = [head]
    for row in result["summary"]:
        t, m, ref = row["tokens_per_s"], row["peak_rss_mib"], row["reference"]
        rows.append((
            row["name"], ref or "-", f"{t['median']:.0f} ({t['min']:.0f}-{t['max']:.0f})",
            benchlib.format_spread(row["ratio_tokens_per_s"]) if ref else "-",
            f"{m['median']:.1f} ({m['min']:.1f}-{m['max']:.1f})",
            benchlib.format_spread(row["ratio_peak_rss"]) if ref else "-",
            f"{100 * row['mfu']['median']:.1f}%",
            f"{100 * row['overlap']['median']:.0f}%" if row.get("overlap") else "-",
            f"{row['bytes_per_step']['median']:.0f}",
            "" if row["bytes_basis"] == "measured" else "analytic"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    return "\n".join(" ".join([r[0].ljust(widths[0])] +
                              [c.rjust(w) for c, w in zip(r[1:-1], widths[1:])] + [r[-1]])
                     .rstrip() for r in rows)


def describe_job(result):
    j = result["job"]
    heads = f"{j['n_head']} heads" + (f", {j['n_kv_head']} key/value heads" if j["n_kv_head"]
                                      else "")
    return (f"{j['kind']}, {j['n_layer']} layers x {j['n_embd']}, {heads}, vocabulary "
            f"{j['vocab_size']}, n_ctx {j['n_ctx']}; Ψ = {result['psi']:,}; {j['nproc']} ranks, "
            f"global batch {j['global_batch']} x {j['seq_len']} tokens, {j['steps']} steps, "
            f"{j['precision']}, {result['pairs']} pairs")


def plot(result, svg):
    """Bars of tokens/s and peak RSS per strategy and peer, min-max as error bars (gnuplot)."""
    rows = result["summary"]
    data = "".join(
        f"{i} \"{r['name']}\" {r['tokens_per_s']['median']} {r['tokens_per_s']['min']} "
        f"{r['tokens_per_s']['max']} {r['peak_rss_mib']['median']} {r['peak_rss_mib']['min']} "
        f"{r['peak_rss_mib']['max']} {0x1f77b4 if r['side'] == 'cai' else 0xff7f0e}\n"
        for i, r in enumerate(rows))
    j = result["job"]
    title = (f"{result['size']}: Ψ = {result['psi']:,}, {j['nproc']} ranks, {j['precision']}, "
             f"{result['pairs']} pairs")
    script = f"""
set terminal svg size 960,420 dynamic noenhanced font "sans,11"
set output '{svg}'
set multiplot layout 1,2 title "{title}"
set style fill solid 0.7 border -1
set xrange [-0.6:{len(rows) - 0.4}]
set yrange [0:*]
set xtics rotate by -30 left nomirror
set bmargin 5
set key off
set grid ytics
$d << EOD
{data}EOD
set title "tokens/s (median, min-max over pairs; cai blue, PyTorch orange)"
plot $d using 1:3:4:5:(0.35):9:xtic(2) with boxerrorbars lc rgb variable
set title "peak RSS of the largest rank, MiB"
plot $d using 1:6:7:8:(0.35):9:xtic(2) with boxerrorbars lc rgb variable
unset multiplot
"""
    subprocess.run(["gnuplot"], input=script, text=True, check=True)


def readme_section(result, results_path):
    plot_path = results_path.resolve().parent / result["plot"]
    link = os.path.relpath(plot_path, README.parent)
    m = result["machine"]
    peaks = ", ".join(f"{s['peak_gflops']:.1f}" for s in result["sgemm"])
    begin, end = markers(result)
    lines = [
        begin,
        "### " + section(result).replace(" ", ", ", 1),
        "",
        f"Generated by `bench/run.py --readme {os.path.relpath(results_path, README.parent.parent)}"
        "` from the run's results.json; edit run.py, not this section.",
        "",
        f"Command: `{result['command']}`",
        "",
        f"- Date: {result['date']}; load average {result['load_average'][0]:.1f} at the start, "
        f"{result['load_average'][1]:.1f} at the end.",
        f"- Machine: {m['os']}, {m['nproc']} CPUs ({m['cpu']}).",
        f"- BLAS (cai rank 0): `{result['blas']}`.",
        f"- Matmul bound (bench/sgemm_peak.py, one thread, the model's matmul shapes in "
        f"{result['sgemm'][0].get('dtype', 'fp32')}, before and after the pairs): {peaks} "
        f"GFLOP/s; MFU = {result['flops_per_token']:,} FLOPs/token "
        f"({result.get('flops_formula', '6Ψ + 12·layers·d·T')}) × "
        f"tokens/s / (ranks × the higher).",
        f"- Job: {describe_job(result)}.",
        "",
        "Per strategy and peer: median (min-max) over pairs; ratios are of the per-pair ratio "
        "against the run named under `vs`; peak RSS is the largest rank's; overlap the least, over "
        "the ranks, share of the gradient reductions' time spent computing rather than waiting "
        "on them (summary.json's overlap_ratio); B/step/rank the bytes one rank hands to "
        "collectives per step.",
        "",
        "```",
        table(result),
        "```",
        "",
    ]
    lines += [f"- {n}" for n in result["notes"]]
    lines += ["", f"![tokens/s and peak RSS per strategy]({link})", end]
    return "\n".join(lines)


def write_readme(results_path):
    result = json.loads(results_path.read_text())
    text = README.read_text()
    body = readme_section(result, results_path)
    BEGIN, END = markers(result)
    begin, end = text.find(BEGIN), text.find(END)
    if begin >= 0 and end > begin:
        README.write_text(text[:begin] + body + text[end + len(END):])
    elif NEW in text:
        at = text.find(NEW)
        README.write_text(text[:at] + body + "\n\n" + text[at:])
    else:
        sys.exit(f"run.py: {README} has neither '{BEGIN}' ... '{END}' to replace nor '{NEW}' "
                 "to add this job's section at; add the line where sections belong")
    print(f"run.py: regenerated the {section(result)} section of "
          f"{README} from {results_path}")


def main():
    args = parse_args(sys.argv[1:])
    if args.readme:
        write_readme(args.readme)
        return
    build = args.build.resolve()
    strategies, peers, refs, notes = plan(args)
    baselines = [refs[s] for s in strategies if refs[s] == s + BASELINE]
    builds = [build] + ([args.baseline.resolve()] if args.baseline else [])
    for b in builds:
        for plugin in {strategy(s)[0] for s in strategies}:
            if not (b / "lib" / "cai" / "plugins" / f"{plugin}.toml").is_file():
                sys.exit(f"run.py: {b} has no lib/cai/plugins/{plugin}.toml; build it first")
    job = {k: getattr(args, k) for k in ("kind", "vocab_size", "n_ctx", "n_layer", "n_head",
                                         "n_kv_head", "n_embd", "global_batch", "seq_len",
                                         "steps", "precision", "nproc")}
    psi = params(args)
    changed = [k for k, v in SIZES[args.size].items() if getattr(args, k) != v]
    size = ", ".join([args.size] + [f"{k} {getattr(args, k)}" for k in changed])
    print(f"{', '.join(strategies)} against {', '.join(peers) or 'no PyTorch peer'}; "
          f"{size}; Ψ = {psi:,}", flush=True)
    load_start = os.getloadavg()[0]
    # The sgemm bound, measured before and after the pairs; MFU is against the higher.
    sgemm = [sgemm_peak(args)]
    runs = []
    with tempfile.TemporaryDirectory(prefix="run_py_") as tmp:
        for pair in range(args.pairs):
            for name in pair_order(pair, strategies, peers, refs):
                base, baseline = on_baseline(name)
                r = (run_candidate(builds[baseline], args, Path(tmp), pair, name)
                     if is_strategy(base) else run_peer(args, name))
                runs.append(dict(r, pair=pair, name=name))
                print(f"pair {pair + 1}  {name:14} {r['tokens_per_s']:9.0f} tokens/s "
                      f"{r['peak_rss_bytes'] / MIB:8.1f} MiB {r['bytes_per_step']:12.0f} B/step",
                      flush=True)
                if r["side"] == "peer" and r["raw"]["params"] != psi:
                    sys.exit(f"run.py: {name} trained {r['raw']['params']:,} parameters, cai's "
                             f"model has {psi:,}: the peer does not build the same model")
    sgemm.append(sgemm_peak(args))
    peak = max(m["peak_gflops"] for m in sgemm) * 1e9
    flops = flops_per_token(args, psi)
    for r in runs:
        r["mfu"] = flops * r["tokens_per_s"] / (args.nproc * peak)
    notes += [f"{r['name']} hung in Gloo in pair {r['pair'] + 1} and was killed after "
              f"{args.timeout} s and run again ({r['raw']['reruns']} time(s))."
              for r in runs if r["side"] == "peer" and r["raw"]["reruns"]]
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": "bench/run.py " + shlex.join(sys.argv[1:]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine(), "load_average": [load_start, os.getloadavg()[0]],
        "blas": next(r["blas"] for r in runs if r["side"] == "cai"),
        "size": size, "job": job, "psi": psi, "pairs": args.pairs, "strategies": strategies,
        "peers": peers, "sgemm": sgemm, "flops_per_token": flops,
        "baseline": ({"build": str(args.baseline), "label": args.baseline_label}
                     if args.baseline else None),
        "section": args.section,
        "flops_formula": FLOPS_FORMULA,
        "notes": notes, "plot": "plot.svg", "runs": runs,
        "summary": summarize(runs, strategies + baselines, peers, refs),
    }
    results_path = args.out / "results.json"
    results_path.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / result["plot"])
    print(table(result))
    for n in notes:
        print("note:", n)
    print(f"run.py: wrote {results_path} and {args.out / result['plot']}")
    if args.write_readme:
        write_readme(results_path)


if __name__ == "__main__":
    main()
