#!/usr/bin/python3
"""The PyTorch peer torch-ddp of bench/run.py and bench/fsdp_bench.py: GPT-2 or Llama under
torch.nn.parallel.DistributedDataParallel (Gloo, CPU) with the same architecture, sizes,
optimizer and batch as the cai job, so the two runs do the same arithmetic and move the same
gradient bytes.

The models are cai's zoo models (host/src/model/zoo.cpp) written with the same ops. GPT-2:
learned positions, pre-LayerNorm blocks, fused qkv, attention as matmul + causal mask + softmax
(torch 1.13 has no fused attention either), tanh-GELU MLP, final LayerNorm, output projection
tied to the token embedding. Llama: RMSNorm with fp32 statistics, rotary embedding in HF's
rotate-half layout, grouped-query attention (key/value heads repeated to the query heads),
SwiGLU MLP of Meta's hidden size, no biases, untied output projection. Both are checked against
transformers' layouts by tests/bench/peers_test.py. AdamW with decay on matrices only, clipping
by global norm, as the job. --precision bf16 runs forward and loss under
torch.autocast("cpu", torch.bfloat16): PyTorch's mixed precision, fp32 weights, gradients and
optimizer state.

Prints one JSON line from rank 0: tokens/s (global tokens per step over the median step time
after the first step) and each rank's peak RSS in bytes (getrusage ru_maxrss).

Run by bench/run.py with OMP_NUM_THREADS=1; by hand:
  OMP_NUM_THREADS=1 /usr/bin/python3 bench/peers/ddp_gpt2_torch.py --nproc 2 --steps 12
  (--model llama --n-kv-head 2, --precision bf16)
"""
import argparse
import contextlib
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


def causal_attention(q, k, v):
    """Attention as cai's MathAttention: matmul, causal mask, softmax, matmul."""
    t = q.size(-2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), -1) @ v


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
        att = causal_attention(split(q), split(k), split(v)).transpose(1, 2).reshape(b, t, e)
        h = x + self.proj(att)
        return h + self.down(F.gelu(self.fc(self.ln_2(h)), approximate="tanh"))


class Gpt2(nn.Module):
    def __init__(self, vocab, ctx, layers, heads, e):
        super().__init__()
        self.wte = nn.Embedding(vocab, e)
        self.wpe = nn.Embedding(ctx, e)
        self.blocks = nn.ModuleList(Block(e, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(e)
        init_normal(self, layers, ("proj.weight", "down.weight"))

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe.weight[: tokens.size(1)]
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def init_normal(model, layers, residual):
    """cai's initialisation: N(0, 0.02) matrices, 0.02 / sqrt(2·layers) for the projections
    into the residual stream (names ending in `residual`), zero biases, unit norm weights."""
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(residual) else 0.02
            nn.init.normal_(p, 0.0, std)


class RmsNorm(nn.Module):
    def __init__(self, e, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(e))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rotate(x, cos, sin):
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


class LlamaBlock(nn.Module):
    def __init__(self, e, heads, kv_heads, ffn):
        super().__init__()
        self.heads, self.kv_heads, d = heads, kv_heads, e // heads
        self.attn_norm = RmsNorm(e)
        self.q = nn.Linear(e, e, bias=False)
        self.k = nn.Linear(e, kv_heads * d, bias=False)
        self.v = nn.Linear(e, kv_heads * d, bias=False)
        self.o = nn.Linear(e, e, bias=False)
        self.mlp_norm = RmsNorm(e)
        self.gate = nn.Linear(e, ffn, bias=False)
        self.up = nn.Linear(e, ffn, bias=False)
        self.down = nn.Linear(ffn, e, bias=False)

    def forward(self, x, cos, sin):
        b, t, e = x.shape
        n = self.attn_norm(x)
        split = lambda y, h: y.view(b, t, h, -1).transpose(1, 2)
        q = rotate(split(self.q(n), self.heads), cos, sin)
        k = rotate(split(self.k(n), self.kv_heads), cos, sin)
        v = split(self.v(n), self.kv_heads)
        group = self.heads // self.kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        h = x + self.o(causal_attention(q, k, v).transpose(1, 2).reshape(b, t, e))
        n = self.mlp_norm(h)
        return h + self.down(F.silu(self.gate(n)) * self.up(n))


class Llama(nn.Module):
    def __init__(self, vocab, ctx, layers, heads, kv_heads, e, rope_theta=10000.0):
        super().__init__()
        ffn = 256 * ((8 * e // 3 + 255) // 256)
        self.embed = nn.Embedding(vocab, e)
        self.blocks = nn.ModuleList(LlamaBlock(e, heads, kv_heads or heads, ffn)
                                    for _ in range(layers))
        self.norm = RmsNorm(e)
        self.lm_head = nn.Linear(e, vocab, bias=False)
        init_normal(self, layers, ("o.weight", "down.weight"))
        d = e // heads
        inv_freq = rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = torch.outer(torch.arange(ctx, dtype=torch.float64), inv_freq)
        angles = torch.cat((angles, angles), -1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        t = tokens.size(1)
        for block in self.blocks:
            x = block(x, self.cos[:t], self.sin[:t])
        return self.lm_head(self.norm(x))


def make_model(args):
    if args.kind == "llama":
        return Llama(args.vocab_size, args.n_ctx, args.n_layer, args.n_head, args.n_kv_head,
                     args.n_embd)
    return Gpt2(args.vocab_size, args.n_ctx, args.n_layer, args.n_head, args.n_embd)


def compute_precision(args):
    """The context forward and loss run in: bf16 autocast, or fp32 as built."""
    if args.precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def adamw(groups, args):
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def rank_main(rank, args, port, results, make_optimizer=adamw, peer="torch_ddp"):
    """One rank: DDP over the model, `make_optimizer(param_groups, args)`, args.steps steps."""
    torch.set_num_threads(1)
    # A rank that fails (e.g. its port taken meanwhile) must not leave the other waiting 30 min.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.nproc, timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(args.seed)
    model = make_model(args)
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
        with compute_precision(args):
            logits = ddp(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                   tokens[:, 1:].reshape(-1))
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


def parser(description, models=("gpt2",), precisions=("fp32",)):
    """The options every peer shares: ranks, steps, batch, model sizes, optimizer; `models`
    and `precisions` are what the peer implements (any other is refused by name)."""
    p = argparse.ArgumentParser(description=description)
    add_model_options(p, models, precisions)
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


EVERY_JOB = dict(models=("gpt2", "llama"), precisions=("fp32", "bf16"))


def main():
    p = parser(__doc__.splitlines()[0], **EVERY_JOB)
    p.add_argument("--gradient-as-bucket-view", dest="gradient_as_bucket_view",
                   action="store_true")
    launch(p.parse_args())


if __name__ == "__main__":
    main()
