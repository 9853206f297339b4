#!/usr/bin/python3
"""The PyTorch peer torch-ulysses of bench/run.py: GPT-2 with DeepSpeed-Ulysses sequence
parallelism written over torch.distributed.all_to_all_single (Gloo, CPU), as DeepSpeed's
DistributedAttention does it, since PyTorch 1.13 has no sequence-parallel API.

Every rank of the --nproc group holds the whole model and runs every layer on its 1/nproc of
each sequence's positions (positions embedded at their offsets); around each attention one
all-to-all turns q, k and v into 1/nproc of the heads at every position and one turns the
output back (autograd Functions whose backward is the other all-to-all), so it moves what cai's
sp_size moves: 4·B·(T/n)·2e elements per block and step. Each rank's loss is its shard's sum
over the global token count, and DDP (averaging over the group) gets it scaled by n, so the
gradients are the whole batch's, as cai's. AdamW with decay on matrices only, clipping by the
global norm, as the cai job. All ranks see the same global batch.

Prints one JSON line from rank 0: tokens/s (global tokens per step over the median step time
after the first step) and each rank's peak RSS in bytes.

Run by bench/run.py with OMP_NUM_THREADS=1; by hand:
  OMP_NUM_THREADS=1 /usr/bin/python3 bench/peers/ulysses_gpt2_torch.py --nproc 2 --steps 12
"""
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddp_gpt2_torch as peer  # noqa: E402  (the model, the shared options and launcher)


def sequence_to_heads(x):
    """[B, H, t, D], every head at this rank's positions -> [B, H/n, n·t, D]."""
    n = dist.get_world_size()
    b, h, t, d = x.shape
    inp = x.reshape(b, n, h // n, t, d).transpose(0, 1).contiguous()
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp)
    return out.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * t, d)


def heads_to_sequence(x):
    """The inverse: [B, H/n, n·t, D] -> [B, H, t, D]."""
    n = dist.get_world_size()
    b, h, whole, d = x.shape
    t = whole // n
    inp = x.reshape(b, h, n, t, d).permute(2, 0, 1, 3, 4).contiguous()
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp)
    return out.transpose(0, 1).reshape(b, n * h, t, d)


class SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return sequence_to_heads(x)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_sequence(grad)


class HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return heads_to_sequence(x)

    @staticmethod
    def backward(ctx, grad):
        return sequence_to_heads(grad)


class Block(peer.Block):
    def forward(self, x):
        b, t, e = x.shape
        n = dist.get_world_size()
        split = lambda y: y.view(b, t, self.heads, -1).transpose(1, 2)
        q, k, v = (split(y) for y in self.qkv(self.ln_1(x)).chunk(3, -1))
        # q, k and v in one all-to-all: each rank's share of the heads of all three together.
        per_rank = lambda y: y.reshape(b, n, self.heads // n, t, -1)
        packed = torch.cat([per_rank(q), per_rank(k), per_rank(v)], 2).reshape(b, -1, t, q.size(-1))
        q, k, v = SequenceToHeads.apply(packed).chunk(3, 1)
        att = HeadsToSequence.apply(peer.causal_attention(q, k, v))
        att = att.transpose(1, 2).reshape(b, t, e)
        h = x + self.proj(att)
        return h + self.down(F.gelu(self.fc(self.ln_2(h)), approximate="tanh"))


class Gpt2(peer.Gpt2):
    def __init__(self, vocab, ctx, layers, heads, e):
        super().__init__(vocab, ctx, layers, heads, e)
        self.blocks = nn.ModuleList(Block(e, heads) for _ in range(layers))
        peer.init_normal(self.blocks, layers, ("proj.weight", "down.weight"))

    def forward(self, tokens):
        n, r = dist.get_world_size(), dist.get_rank()
        t = tokens.size(1) // n
        shard = tokens[:, r * t:(r + 1) * t]
        x = self.wte(shard) + self.wpe.weight[r * t:(r + 1) * t]
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def rank_main(rank, args, port, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.nproc, timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(args.seed)  # every rank: the same weights
    model = Gpt2(args.vocab_size, args.n_ctx, args.n_layer, args.n_head, args.n_embd)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = peer.adamw([{"params": decay, "weight_decay": args.weight_decay},
                      {"params": no_decay, "weight_decay": 0.0}], args)
    gen = torch.Generator().manual_seed(args.seed)  # every rank: the same global batch
    t = args.seq_len // args.nproc
    times = []
    for _ in range(args.steps):
        tokens = torch.randint(0, args.vocab_size, (args.global_batch, args.seq_len + 1),
                               generator=gen)
        start = time.perf_counter()
        logits = ddp(tokens[:, :-1])
        targets = tokens[:, 1:][:, rank * t:(rank + 1) * t]
        total = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                reduction="sum")
        (total * args.nproc / (args.global_batch * args.seq_len)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    peer.report(rank, args, results, "torch_ulysses", times,
                sum(p.numel() for p in model.parameters()))
    os._exit(0)  # as the DDP peer: no Gloo teardown


def main():
    args = peer.parser(__doc__.splitlines()[0]).parse_args()
    if args.seq_len % args.nproc or args.n_head % args.nproc:
        sys.exit(f"ulysses_gpt2_torch: --seq-len {args.seq_len} and --n-head {args.n_head} must "
                 f"divide by --nproc {args.nproc}")
    peer.launch(args, fn=rank_main)


if __name__ == "__main__":
    main()
