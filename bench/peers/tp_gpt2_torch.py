#!/usr/bin/python3
"""The PyTorch peer torch-tp of bench/run.py: GPT-2 with Megatron-LM tensor parallelism written
by hand over torch.distributed (Gloo, CPU), since PyTorch 1.13 has no tensor-parallel API.

Every rank of the --nproc group holds its slice of each block: column-parallel fused q/k/v
(each of q, k, v split by heads) and MLP up projection, row-parallel attention output and MLP
down projection with the bias added once after the all-reduce, and the token embedding split
over the vocabulary (padded to a multiple of 64 x nproc) with a vocabulary-parallel lookup and
a distributed cross-entropy, the tied output projection reading the same slice. Megatron's f
(identity forward, all-reduce backward) and g (all-reduce forward, identity backward) are
autograd Functions here, so it moves what cai's tp_size moves: (4L + 2)·B·T·e elements plus
3·B·T for the loss per step. AdamW with decay on matrices only, clipping by the global norm
(the whole parameters counted once), as the cai job. All ranks see the same global batch.

Prints one JSON line from rank 0: tokens/s (global tokens per step over the median step time
after the first step), each rank's peak RSS in bytes and the parameter count of the whole model.

Run by bench/run.py with OMP_NUM_THREADS=1; by hand:
  OMP_NUM_THREADS=1 /usr/bin/python3 bench/peers/tp_gpt2_torch.py --nproc 2 --steps 12
"""
import datetime
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddp_gpt2_torch as peer  # noqa: E402  (the shared options and launcher)


class CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, start, vocab):
        part = logits.size(1)
        real = max(0, min(part, vocab - start))
        logits = logits[:, :real]
        m = logits.max(1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        e = (logits - m.unsqueeze(1)).exp()
        s = e.sum(1)
        dist.all_reduce(s)
        here = (targets >= start) & (targets < start + real)
        col = (targets - start).masked_fill(~here, 0)
        picked = logits.gather(1, col.unsqueeze(1)).squeeze(1).masked_fill(~here, 0)
        dist.all_reduce(picked)
        ctx.save_for_backward(e / s.unsqueeze(1), col, here)
        ctx.part = part
        return (s.log() + m - picked).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, col, here = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(1, col.unsqueeze(1), -here.to(g.dtype).unsqueeze(1))
        g.mul_(grad / g.size(0))
        return F.pad(g, (0, ctx.part - g.size(1))), None, None, None


class Block(nn.Module):
    def __init__(self, e, heads, tp):
        super().__init__()
        self.heads = heads // tp
        self.ln_1 = nn.LayerNorm(e)
        self.qkv = nn.Linear(e, 3 * e // tp)
        self.proj_w = nn.Parameter(torch.empty(e, e // tp))
        self.proj_b = nn.Parameter(torch.zeros(e))
        self.ln_2 = nn.LayerNorm(e)
        self.fc = nn.Linear(e, 4 * e // tp)
        self.down_w = nn.Parameter(torch.empty(e, 4 * e // tp))
        self.down_b = nn.Parameter(torch.zeros(e))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(CopyToGroup.apply(self.ln_1(x))).chunk(3, -1)
        split = lambda y: y.view(b, t, self.heads, -1).transpose(1, 2)
        q, k, v = split(q), split(k), split(v)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), -1)
        att = (probs @ v).transpose(1, 2).contiguous().view(b, t, -1)
        h = x + ReduceFromGroup.apply(F.linear(att, self.proj_w)) + self.proj_b
        up = F.gelu(self.fc(CopyToGroup.apply(self.ln_2(h))), approximate="tanh")
        return h + ReduceFromGroup.apply(F.linear(up, self.down_w)) + self.down_b


class Gpt2(nn.Module):
    def __init__(self, vocab, ctx, layers, heads, e, tp, rank):
        super().__init__()
        multiple = 64 * tp
        self.vocab = vocab
        self.part = (vocab + multiple - 1) // multiple * multiple // tp
        self.start = rank * self.part
        self.wte = nn.Parameter(torch.empty(self.part, e))
        self.wpe = nn.Parameter(torch.empty(ctx, e))
        self.blocks = nn.ModuleList(Block(e, heads, tp) for _ in range(layers))
        self.ln_f = nn.LayerNorm(e)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                residual = name.endswith(("proj_w", "down_w"))
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers) if residual else 0.02)
            elif name.endswith(("qkv.bias", "fc.bias")):
                nn.init.zeros_(p)

    def forward(self, tokens, targets):
        outside = (tokens < self.start) | (tokens >= self.start + self.part)
        rows = F.embedding((tokens - self.start).masked_fill(outside, 0), self.wte)
        x = ReduceFromGroup.apply(rows.masked_fill(outside.unsqueeze(-1), 0))
        x = x + self.wpe[: tokens.size(1)]
        for block in self.blocks:
            x = block(x)
        logits = F.linear(CopyToGroup.apply(self.ln_f(x)), self.wte)
        return VocabParallelCrossEntropy.apply(logits.reshape(-1, self.part), targets.reshape(-1),
                                               self.start, self.vocab)


def split(name):
    """Whether a parameter is a slice (its square summed over the group) or whole."""
    return name in ("wte",) or name.endswith(("qkv.weight", "qkv.bias", "fc.weight", "fc.bias",
                                              "proj_w", "down_w"))


def clip(model, max_norm):
    squares = torch.zeros(2, dtype=torch.float64)
    for name, p in model.named_parameters():
        squares[0 if split(name) else 1] += p.grad.double().pow(2).sum()
    sliced = squares[:1].clone()
    dist.all_reduce(sliced)
    norm = math.sqrt(sliced.item() + squares[1].item())
    scale = max_norm / (norm + 1e-6)
    if scale < 1:
        for p in model.parameters():
            p.grad.mul_(scale)


def rank_main(rank, args, port, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.nproc, timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(args.seed + rank)
    model = Gpt2(args.vocab_size, args.n_ctx, args.n_layer, args.n_head, args.n_embd, args.nproc,
                 rank)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)  # every rank: the same global batch
    times = []
    for _ in range(args.steps):
        tokens = torch.randint(0, args.vocab_size, (args.global_batch, args.seq_len + 1),
                               generator=gen)
        start = time.perf_counter()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        clip(model, args.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    local = [0, 0]
    for name, p in model.named_parameters():
        local[0 if split(name) else 1] += p.numel()
    counts = [None] * args.nproc
    dist.all_gather_object(counts, local)
    padding = (model.part * args.nproc - args.vocab_size) * args.n_embd
    peer.report(rank, args, results, "torch_megatron_tp", times,
                sum(c[0] for c in counts) + counts[0][1] - padding)
    os._exit(0)  # as the DDP peer: no Gloo teardown


def main():
    args = peer.parser(__doc__.splitlines()[0]).parse_args()
    peer.launch(args, fn=rank_main)


if __name__ == "__main__":
    main()
