"""A plain torchrun-style DDP script: it reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT from its environment, trains, and rank 0 saves. Runs unchanged under

    torchrun --nproc-per-node 2 examples/torchrun_script.py --steps 20 --out /tmp/ddp.pt
    ray-ddp launch --workers 2 examples/torchrun_script.py --steps 20 --out /tmp/ddp.pt
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="ddp_model.pt")
    parser.add_argument("--fail-on-rank", type=int, default=-1, help="for tests: this rank exits 3")
    parser.add_argument("--raise-on-rank", type=int, default=-1,
                        help="for tests: this rank raises a RuntimeError")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")  # env:// from the variables
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()) \
        if use_cuda else torch.device("cpu")
    print(f"rank {rank} of {world} ready", flush=True)
    if rank == args.fail_on_rank:
        raise SystemExit(3)
    if rank == args.raise_on_rank:
        raise RuntimeError(f"injected failure on rank {rank}")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)).to(device)
    ddp = DDP(model, device_ids=[device] if use_cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1000 + rank)
    for step in range(args.steps):
        x = torch.randn(32, 10, generator=g).to(device)
        loss = (ddp(x) - x[:, :5]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1} loss {loss.item():.4f} world {world}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), args.out)
        print(f"saved {args.out}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
