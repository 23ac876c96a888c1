"""The benchmark's DDP workload, written plainly: what the baselines run on each rank.

Runs inside a training process (a torchrun rank, or a plain Ray Train worker). The same
MLP (``ray_ddp.models.build_mlp``, so the three arms train identical networks), the
same batch per worker, SGD with momentum, mean-squared error on the very rows ray-ddp's
synthetic source makes (``ray_ddp.data.synthetic_rows``): on a CPU the speed of a step
depends a little on the numbers in it, so the arms must train on the same data. Rank 0 times the steps itself and writes one JSON
file per rank: when the first step ended, when the warm-up ended, when the last step
ended (wall-clock epoch seconds, comparable with the launcher's clock), and the
process's peak memory.

Run directly it is the torchrun arm:
    torchrun --standalone --nproc-per-node 2 benchmarks/workload.py --out DIR ...
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--input-dim", type=int, default=256)
    parser.add_argument("--output-dim", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=64, help="rows per worker per step")
    parser.add_argument("--warmup", type=int, default=20, help="steps before the clock starts")
    parser.add_argument("--steps", type=int, default=200, help="timed steps after the warm-up")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--amp", choices=("off", "bf16"), default="off",
                        help="bf16: forward passes under torch.autocast, as ray-ddp's --amp bf16")


def train(args, model: torch.nn.Module, device: torch.device, rank: int, world: int,
          epoch_end: Optional[Callable[[int, float], None]] = None, every: int = 0) -> dict:
    """Train ``warmup + steps`` steps; return this rank's timings.

    ``epoch_end(step, loss)`` is called every ``every`` steps (plain Ray Train reports
    there, as its docs do once per epoch)."""
    from ray_ddp.data.synth import synthetic_rows, teacher_weights
    from ray_ddp.worker.devices import peak_memory_mb

    teacher = teacher_weights(args.seed, args.input_dim, args.output_dim).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = {}
    total = args.warmup + args.steps
    loss_sum = torch.zeros((), device=device)
    for step in range(1, total + 1):
        x, y = synthetic_rows(teacher, args.seed, 0, step, rank * args.batch_size, args.batch_size)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp == "bf16"):
            out = model(x)
        # outside autocast and in fp32, as ray-ddp's loop computes its loss (a bf16 output
        # against an fp32 target fails in backward: "Found dtype Float but expected BFloat16")
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach()
        if step in (1, args.warmup, total):
            sync()
            times[{1: "first_step_at", args.warmup: "warm_at", total: "end_at"}[step]] = time.time()
        if epoch_end is not None and every and step % every == 0:
            epoch_end(step, (loss_sum / every).item())
            loss_sum.zero_()
    return {"rank": rank, "world_size": world, "steps": args.steps, "batch_size": args.batch_size,
            "threads": torch.get_num_threads(), **times, **peak_memory_mb(device)}


def write_result(out_dir: str, result: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank_{result['rank']}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_workload_args(parser)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ray_ddp.models.builtin import build_mlp

    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = build_mlp(args.input_dim, args.output_dim, args.width, args.depth).to(device)
    model = DDP(model, device_ids=[device] if use_cuda else None)
    write_result(args.out, train(args, model, device, rank, world))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
