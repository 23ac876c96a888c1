"""The torchrun arm of benchmarks/loader.py, written as a user would: DistributedSampler
and DataLoader(num_workers=N) over the slow Dataset, DDP over the same MLP as ray-ddp's
``--model mlp``, SGD, mean-squared error. Rank 0 writes when step --warmup ended and when
the last step ended.

    SLOW_READS_ROWS=... torchrun --standalone --nproc-per-node 2 benchmarks/loader_workload.py --out DIR ...
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from slow_reads import slow_reads


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--loader-workers", type=int, required=True)
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--depth", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--lr", type=float, default=0.01)
    args = p.parse_args()
    from ray_ddp.models.builtin import build_mlp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = slow_reads()
    model = DDP(build_mlp(data.x.shape[1], data.y.shape[1], args.width, args.depth))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=args.loader_workers,
                        persistent_workers=args.loader_workers > 0)
    warm_at = None
    step = 0
    for x, y in loader:
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()
        step += 1
        if step == args.warmup:
            warm_at = time.time()
    end_at = time.time()
    if rank == 0:
        with open(os.path.join(args.out, "rank_0.json"), "w") as f:
            json.dump({"warm_at": warm_at, "end_at": end_at, "steps": step}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
