"""The PyTorch DDP tutorial's three demos, run on a Ray cluster through ray_ddp.spawn.

Copied from the tutorial with only these lines changed:
- setup(): no hard-coded MASTER_ADDR / MASTER_PORT (ray_ddp.spawn sets them, with a free
  port on rank 0's node) and the backend follows the device (nccl on GPU, gloo on CPU);
- `.to(rank)` / `device_ids=[rank]` became `ray_ddp.device()`: Ray gives each process its
  own GPU as cuda:0, and on a cluster GPU index and rank are unrelated anyway;
- run_demo() calls ray_ddp.spawn instead of torch.multiprocessing.spawn.

    python examples/tutorial_spawn.py            # 2 processes on a local Ray (CPU: gloo)
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

import ray_ddp


def setup(rank, world_size):
    backend = "nccl" if torch.cuda.is_available() else "gloo"  # changed
    dist.init_process_group(backend, rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)

    device = ray_ddp.device()  # changed: was rank
    model = ToyModel().to(device)
    ddp_model = DDP(model, device_ids=[device] if device.type == "cuda" else None)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5).to(device)
    loss_fn(outputs, labels).backward()
    optimizer.step()

    cleanup()
    return [p.detach().cpu() for p in model.parameters()]


def demo_checkpoint(rank, world_size):
    print(f"Running DDP checkpoint example on rank {rank}.")
    setup(rank, world_size)

    device = ray_ddp.device()  # changed: was rank
    model = ToyModel().to(device)
    ddp_model = DDP(model, device_ids=[device] if device.type == "cuda" else None)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    CHECKPOINT_PATH = tempfile.gettempdir() + "/model.checkpoint"
    if rank == 0:
        # All processes should see same parameters as they all start from same
        # random parameters and gradients are synchronized in backward passes.
        # Therefore, saving it in one process is sufficient.
        torch.save(ddp_model.state_dict(), CHECKPOINT_PATH)

    # Use a barrier() to make sure that process 1 loads the model after process
    # 0 saves it.
    dist.barrier()
    # configure map_location properly
    map_location = device  # changed: was {'cuda:0': 'cuda:%d' % rank}
    ddp_model.load_state_dict(
        torch.load(CHECKPOINT_PATH, map_location=map_location))

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5).to(device)
    loss_fn = nn.MSELoss()
    loss_fn(outputs, labels).backward()
    optimizer.step()

    # Not necessary to use a dist.barrier() to guard the file deletion below
    # as the AllReduce ops in the backward pass of DDP already served as
    # a synchronization.

    if rank == 0:
        os.remove(CHECKPOINT_PATH)

    cleanup()
    return [p.detach().cpu() for p in model.parameters()]


class ToyMpModel(nn.Module):
    def __init__(self, dev0, dev1):
        super(ToyMpModel, self).__init__()
        self.dev0 = dev0
        self.dev1 = dev1
        self.net1 = torch.nn.Linear(10, 10).to(dev0)
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(10, 5).to(dev1)

    def forward(self, x):
        x = x.to(self.dev0)
        x = self.relu(self.net1(x))
        x = x.to(self.dev1)
        return self.net2(x)


def demo_model_parallel(rank, world_size):
    print(f"Running DDP with model parallel example on rank {rank}.")
    setup(rank, world_size)

    # setup mp_model and devices for this process
    devs = ray_ddp.devices()  # changed: was rank * 2, rank * 2 + 1
    dev0, dev1 = devs[0], devs[-1]
    mp_model = ToyMpModel(dev0, dev1)
    ddp_mp_model = DDP(mp_model)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_mp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    # outputs will be on dev1
    outputs = ddp_mp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5).to(dev1)
    loss_fn(outputs, labels).backward()
    optimizer.step()

    cleanup()
    return [p.detach().cpu() for p in mp_model.parameters()]


def run_demo(demo_fn, world_size, gpus_per_process=0):
    return ray_ddp.spawn(demo_fn,  # changed: was mp.spawn
                         args=(world_size,),
                         nprocs=world_size,
                         gpus_per_process=gpus_per_process,
                         join=True)


if __name__ == "__main__":
    gpus = torch.cuda.device_count()
    world = int(sys.argv[1]) if len(sys.argv) > 1 else max(2, gpus)
    run_demo(demo_basic, world, gpus_per_process=1 if gpus else 0)
    run_demo(demo_checkpoint, world, gpus_per_process=1 if gpus else 0)
    run_demo(demo_model_parallel, max(1, world // 2) if gpus >= 2 else world,
             gpus_per_process=2 if gpus >= 2 else 0)
    print("all three tutorial demos ran")
