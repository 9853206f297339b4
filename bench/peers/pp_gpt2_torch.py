#!/usr/bin/python3
"""The PyTorch peer of bench/pp_bench.py: the same GPT-2 split into pipeline stages, one stage
per rank, trained with a hand-written 1F1B schedule (PipeDream-Flush: min(p - r - 1, m)
warm-up forwards, then one forward one backward, then the remaining backwards) over
torch.distributed isend/irecv on Gloo. PyTorch 1.13 has no 1F1B of its own (its Pipe is a
single-process GPipe).

Stages: the transformer blocks spread evenly, the remainder to the middle stages (as cai's
hybrid_parallel and ColossalAI place them); stage 0 also holds the embeddings, the last stage
the final LayerNorm and a copy of the token embedding for the tied head, whose gradient the
first and last stage sum after backward. Each micro-batch's loss is weighted by 1/m. AdamW with
decay on matrices only and clipping by the global norm across stages, as the cai job.

Prints one JSON line from rank 0, as the other peers: tokens/s (global tokens per step over the
median step time after the first), each rank's peak RSS, and each rank's busy fraction of the
step (time in its stage's forward/backward).

  OMP_NUM_THREADS=1 /usr/bin/python3 bench/peers/pp_gpt2_torch.py --nproc 2 --microbatches 8
"""
import datetime
import math
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddp_gpt2_torch import Block, launch, parser


def layers_of(stage, stages, layers):
    per = [layers // stages] * stages
    rest = layers % stages
    start = stages // 2 - rest // 2
    for i in range(start, start + rest):
        per[i] += 1
    first = sum(per[:stage])
    return range(first, first + per[stage])


def rank_main(rank, args, port, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.nproc, timeout=datetime.timedelta(seconds=120))
    p, last = args.nproc, args.nproc - 1
    torch.manual_seed(args.seed)
    e = args.n_embd
    # Every rank builds the whole model from one seed (as cai does) and keeps its stage.
    wte, wpe = nn.Embedding(args.vocab_size, e), nn.Embedding(args.n_ctx, e)
    blocks = [Block(e, args.n_head) for _ in range(args.n_layer)]
    ln_f = nn.LayerNorm(e)
    for module in [wte, wpe] + blocks:
        for name, w in module.named_parameters():
            if w.dim() >= 2:
                std = 0.02 / math.sqrt(2 * args.n_layer) if name.endswith(
                    ("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(w, 0.0, std)
    mine = nn.ModuleList(blocks[i] for i in layers_of(rank, p, args.n_layer))
    params = list(mine.parameters())
    if rank == 0:
        params += list(wte.parameters()) + list(wpe.parameters())
    if rank == last:
        params += list(ln_f.parameters())
        if rank != 0:
            params += list(wte.parameters())  # the tied head's copy
    tied = dist.new_group([0, last]) if p > 1 else None
    decay = [w for w in params if w.dim() >= 2]
    no_decay = [w for w in params if w.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    m = args.microbatches
    rows = args.global_batch // m
    gen = torch.Generator().manual_seed(args.seed)
    times, busy = [], []

    def forward(tokens, x):
        if rank == 0:
            x = wte(tokens[:, :-1]) + wpe.weight[: tokens.size(1) - 1]
        for block in mine:
            x = block(x)
        if rank != last:
            return x
        logits = F.linear(ln_f(x), wte.weight)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)),
                               tokens[:, 1:].reshape(-1)) / m

    for _ in range(args.steps):
        batch = torch.randint(0, args.vocab_size, (args.global_batch, args.seq_len + 1),
                              generator=gen)
        start = time.perf_counter()
        work = 0.0
        inputs, outputs, pending = {}, {}, []
        warmup = min(p - rank - 1, m)
        order = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i), ("B", i)]
        order += [("B", i) for i in range(m - warmup, m)]
        for kind, i in order:
            tokens = batch[i * rows:(i + 1) * rows]
            if kind == "F":
                x = None
                if rank > 0:
                    x = torch.empty(rows, args.seq_len, e)
                    dist.irecv(x, rank - 1, tag=i).wait()
                    x.requires_grad_(True)
                t0 = time.perf_counter()
                y = forward(tokens, x)
                work += time.perf_counter() - t0
                inputs[i], outputs[i] = x, y
                if rank < last:
                    pending.append(dist.isend(y.detach(), rank + 1, tag=i))
            else:
                y, x = outputs.pop(i), inputs.pop(i)
                t0 = time.perf_counter()
                if rank == last:
                    y.backward()
                else:
                    g = torch.empty_like(y)
                    work += time.perf_counter() - t0
                    dist.irecv(g, rank + 1, tag=10000 + i).wait()
                    t0 = time.perf_counter()
                    y.backward(g)
                work += time.perf_counter() - t0
                if rank > 0:
                    pending.append(dist.isend(x.grad, rank - 1, tag=10000 + i))
        for w in pending:
            w.wait()
        if p > 1 and rank in (0, last):
            dist.all_reduce(wte.weight.grad, group=tied)
        # The global norm across stages, the tied embedding counted once (on stage 0).
        counted = [w for w in params if not (rank == last and rank != 0 and w is wte.weight)]
        sq = torch.tensor([sum(float(w.grad.pow(2).sum()) for w in counted)], dtype=torch.float64)
        dist.all_reduce(sq)
        clip = min(1.0, args.max_grad_norm / (math.sqrt(sq.item()) + 1e-6))
        for w in params:
            w.grad.mul_(clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        busy.append(work / times[-1])
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gathered = [None] * args.nproc
    dist.all_gather_object(gathered, (peak_rss, statistics.median(busy[1:])))
    if rank == 0:
        step = statistics.median(times[1:])
        results.put({"peer": "torch_1f1b", "torch": torch.__version__, "ranks": args.nproc,
                     "microbatches": m, "tokens_per_s": args.global_batch * args.seq_len / step,
                     "median_step_time_s": step, "peak_rss_bytes": [g[0] for g in gathered],
                     "busy_fraction": [g[1] for g in gathered]})
    dist.destroy_process_group()


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=8)
    args = p.parse_args()
    if args.global_batch % args.microbatches:
        p.error("--global-batch must be a multiple of --microbatches")
    launch(args, fn=rank_main)


if __name__ == "__main__":
    main()
