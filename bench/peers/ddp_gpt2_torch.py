#!/usr/bin/python3
"""The PyTorch peer torch-ddp of bench/run.py and bench/fsdp_bench.py: GPT-2 under
torch.nn.parallel.DistributedDataParallel (Gloo, CPU) with the same architecture, sizes,
optimizer and batch as the cai job, so the two runs do the same arithmetic and move the same
gradient bytes.

The model is cai's zoo GPT-2 (host/src/model/zoo.cpp) written with the same ops: learned
positions, pre-LayerNorm blocks, fused qkv, attention as matmul + causal mask + softmax (torch
1.13 has no fused attention either), tanh-GELU MLP, final LayerNorm, output projection tied to
the token embedding. AdamW with decay on matrices only, clipping by global norm, as the job.

Prints one JSON line from rank 0: tokens/s (global tokens per step over the median step time
after the first step) and each rank's peak RSS in bytes (getrusage ru_maxrss).

Run by bench/run.py with OMP_NUM_THREADS=1; by hand:
  OMP_NUM_THREADS=1 /usr/bin/python3 bench/peers/ddp_gpt2_torch.py --nproc 2 --steps 12
"""
import argparse
import datetime
import json
import math
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import add_model_options  # noqa: E402  (the sizes cai's side takes, one definition)


class Block(nn.Module):
    def __init__(self, e, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(e)
        self.qkv = nn.Linear(e, 3 * e)
        self.proj = nn.Linear(e, e)
        self.ln_2 = nn.LayerNorm(e)
        self.fc = nn.Linear(e, 4 * e)
        self.down = nn.Linear(4 * e, e)

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = self.qkv(self.ln_1(x)).chunk(3, -1)
        split = lambda y: y.view(b, t, self.heads, -1).transpose(1, 2)
        q, k, v = split(q), split(k), split(v)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), -1)
        att = (probs @ v).transpose(1, 2).contiguous().view(b, t, e)
        h = x + self.proj(att)
        return h + self.down(F.gelu(self.fc(self.ln_2(h)), approximate="tanh"))


class Gpt2(nn.Module):
    def __init__(self, vocab, ctx, layers, heads, e):
        super().__init__()
        self.wte = nn.Embedding(vocab, e)
        self.wpe = nn.Embedding(ctx, e)
        self.blocks = nn.ModuleList(Block(e, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(e)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe.weight[: tokens.size(1)]
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def adamw(groups, args):
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def rank_main(rank, args, port, results, make_optimizer=adamw, peer="torch_ddp"):
    """One rank: DDP over the model, `make_optimizer(param_groups, args)`, args.steps steps."""
    torch.set_num_threads(1)
    # A rank that fails (e.g. its port taken meanwhile) must not leave the other waiting 30 min.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.nproc, timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(args.seed)
    model = Gpt2(args.vocab_size, args.n_ctx, args.n_layer, args.n_head, args.n_embd)
    ddp = nn.parallel.DistributedDataParallel(
        model, bucket_cap_mb=args.bucket_cap_mb,
        gradient_as_bucket_view=getattr(args, "gradient_as_bucket_view", False))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = make_optimizer([{"params": decay, "weight_decay": args.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}], args)
    local = args.global_batch // args.nproc
    gen = torch.Generator().manual_seed(args.seed + rank)
    times = []
    for _ in range(args.steps):
        tokens = torch.randint(0, args.vocab_size, (local, args.seq_len + 1), generator=gen)
        start = time.perf_counter()
        logits = ddp(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    report(rank, args, results, peer, times, sum(p.numel() for p in model.parameters()))
    # Every figure is out. Tearing DDP down can deadlock in PyTorch 1.13 (~ProcessGroupGloo
    # waits for a mutex its worker thread holds while that thread waits for the GIL: seen under
    # gdb, one run in a few at 30M), so the rank leaves without running destructors.
    os._exit(0)


def report(rank, args, results, peer, times, params):
    """Puts rank 0's JSON figures on `results`: tokens/s over the median step after the first,
    every rank's peak RSS (collective: every rank calls it)."""
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gathered = [None] * args.nproc
    dist.all_gather_object(gathered, peak_rss)
    if rank == 0:
        step = statistics.median(times[1:])
        results.put({"peer": peer, "torch": torch.__version__, "ranks": args.nproc,
                     "tokens_per_s": args.global_batch * args.seq_len / step,
                     "median_step_time_s": step, "peak_rss_bytes": gathered, "params": params})


def parser(description):
    """The options every peer shares: ranks, steps, batch, model sizes, optimizer."""
    p = argparse.ArgumentParser(description=description)
    add_model_options(p)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", dest="weight_decay", type=float, default=0.1)
    p.add_argument("--max-grad-norm", dest="max_grad_norm", type=float, default=1.0)
    p.add_argument("--bucket-cap-mb", dest="bucket_cap_mb", type=float, default=25)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--port", type=int, default=0, help="rendezvous port (0: a free one)")
    return p


def launch(args, *rank_args, fn=None):
    """Runs fn(rank, args, port, results, *rank_args) (default: rank_main) on args.nproc
    processes; prints rank 0's JSON line."""
    if args.port == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(fn or rank_main, args=(args, args.port, results) + rank_args,
                       nprocs=args.nproc, start_method="spawn")
    print(json.dumps(results.get()))


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--gradient-as-bucket-view", dest="gradient_as_bucket_view",
                   action="store_true")
    launch(p.parse_args())


if __name__ == "__main__":
    main()
