#!/usr/bin/python3
"""The PyTorch peer torch-zero of bench/run.py and bench/fsdp_bench.py: GPT-2 or Llama under
DistributedDataParallel with torch.distributed.optim.ZeroRedundancyOptimizer (PyTorch's ZeRO-1:
gradients all-reduced by DDP, AdamW state sharded by parameter across ranks, updated parameters
broadcast from their owner), Gloo on CPU.

The models are those of bench/peers/ddp_gpt2_torch.py (cai's zoo GPT-2 and Llama written with
the same ATen ops), imported from there with its training loop and bf16 autocast; optimizer,
clipping and batch as the cai job.

Prints one JSON line from rank 0: tokens/s (global tokens per step over the median step time
after the first step), each rank's peak RSS in bytes (getrusage ru_maxrss) and the model's
parameter count.

Run by bench/run.py with OMP_NUM_THREADS=1; by hand:
  OMP_NUM_THREADS=1 /usr/bin/python3 bench/peers/zero_gpt2_torch.py --nproc 2 --steps 12
"""
import os
import sys

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddp_gpt2_torch as peer  # noqa: E402  (the same model, loop and launcher as the DDP peer)


def zero_adamw(groups, args):
    return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW,
                                   parameters_as_bucket_view=args.parameters_as_bucket_view,
                                   lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def main():
    p = peer.parser(__doc__.splitlines()[0], **peer.EVERY_JOB)
    p.add_argument("--parameters-as-bucket-view", dest="parameters_as_bucket_view",
                   action="store_true")
    peer.launch(p.parse_args(), zero_adamw, "torch_zero_redundancy_optimizer")


if __name__ == "__main__":
    main()
