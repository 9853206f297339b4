#!/usr/bin/python3
"""The second PyTorch peer of bench/pp_bench.py: PyTorch 1.13's own pipeline,
torch.distributed.pipeline.sync.Pipe (GPipe: all forwards, then all backwards), on the same
GPT-2 cut into the same two stages.

Pipe is single-process: it runs each partition on the device its parameters live on, one
worker thread per device. On a CPU-only machine both partitions live on "cpu", so the stages
share one worker and the micro-batches run one after another; what Pipe adds over plain
gradient accumulation here is its micro-batching only. To use the same two cores as the
two-rank runs, this process runs with two intra-op threads (--threads). Same AdamW, clipping
and micro-batch loss weighting as the 1F1B peer.

Prints one JSON line, as the other peers: tokens/s (global tokens per step over the median
step time after the first) and the process's peak RSS.

  /usr/bin/python3 bench/peers/gpipe_gpt2_torch.py --microbatches 8
"""
import json
import os
import resource
import socket
import statistics
import time

import torch
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipeline.sync import Pipe

from ddp_gpt2_torch import Gpt2, parser
from pp_gpt2_torch import layers_of


class Embed(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.wte, self.wpe = model.wte, model.wpe

    def forward(self, tokens):
        return self.wte(tokens) + self.wpe.weight[: tokens.size(1)]


class Head(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.ln_f, self.wte = model.ln_f, model.wte  # the tied head reads the token embedding

    def forward(self, x):
        return F.linear(self.ln_f(x), self.wte.weight)


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.global_batch % args.microbatches:
        p.error("--global-batch must be a multiple of --microbatches")
    torch.set_num_threads(args.threads)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    rpc.init_rpc("gpipe", rank=0, world_size=1)  # Pipe's RRef outputs need the RPC framework
    torch.manual_seed(args.seed)
    model = Gpt2(args.vocab_size, args.n_ctx, args.n_layer, args.n_head, args.n_embd)
    stages = [nn.Sequential(Embed(model), *(model.blocks[i] for i in layers_of(0, 2, args.n_layer))),
              nn.Sequential(*(model.blocks[i] for i in layers_of(1, 2, args.n_layer)), Head(model))]
    pipe = Pipe(nn.Sequential(*stages), chunks=args.microbatches, checkpoint="never")
    decay = [w for w in model.parameters() if w.dim() >= 2]
    no_decay = [w for w in model.parameters() if w.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)
    times = []
    for _ in range(args.steps):
        batch = torch.randint(0, args.vocab_size, (args.global_batch, args.seq_len + 1),
                              generator=gen)
        start = time.perf_counter()
        logits = pipe(batch[:, :-1]).local_value()
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    step = statistics.median(times[1:])
    print(json.dumps({"peer": "torch_gpipe", "torch": torch.__version__, "ranks": 1,
                      "threads": args.threads, "microbatches": args.microbatches,
                      "tokens_per_s": args.global_batch * args.seq_len / step,
                      "median_step_time_s": step,
                      "peak_rss_bytes": [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]}))
    rpc.shutdown()


if __name__ == "__main__":
    main()
