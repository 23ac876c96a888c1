"""User-side models for tests of --model package.module:callable."""

import torch
from torch import nn


def small_net() -> nn.Module:
    """A user's own network for the 10 -> 5 synthetic task."""
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 5))


def frozen_net() -> nn.Module:
    """Nothing to train: DDP refuses such a module."""
    net = nn.Linear(10, 5)
    for p in net.parameters():
        p.requires_grad_(False)
    return net


def not_a_module():
    return torch.zeros(3)


def raises():
    raise RuntimeError("weights file missing")


class SlowToy(torch.nn.Module):
    """The tutorial's ToyModel (same layers, same init for a seed) that takes ~0.1 s a
    step and leaves its pid in $TMPDIR/ray_ddp_test_pids/<run>/<rank>.pid, so a test can
    kill a real training worker in mid-run."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)
        self._pid_written = False

    def forward(self, x):
        if not self._pid_written:
            _write_pid()
            self._pid_written = True
        import time

        time.sleep(0.1)
        return self.net2(self.relu(self.net1(x)))


def _write_pid():
    import os
    import tempfile

    import ray.train

    ctx = ray.train.get_context()
    folder = os.path.join(tempfile.gettempdir(), "ray_ddp_test_pids", ctx.get_experiment_name())
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{ctx.get_world_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))


def slow_toy() -> nn.Module:
    return SlowToy()


class NanAfter(torch.nn.Module):
    """A ToyModel whose output turns NaN from its 14th forward call on."""

    def __init__(self, calls: int = 13):
        super().__init__()
        self.net = nn.Linear(10, 5)
        self.calls, self.limit = 0, calls

    def forward(self, x):
        self.calls += 1
        out = self.net(x)
        return out * float("nan") if self.calls > self.limit else out


def nan_after_13() -> nn.Module:
    return NanAfter()


class SlowOnRankOne(torch.nn.Module):
    """ToyModel whose forward pass takes 40 ms longer on rank 1: a straggler."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        import time

        import torch.distributed as dist

        if dist.get_rank() == 1:
            time.sleep(0.04)
        return self.net2(self.relu(self.net1(x)))


def slow_on_rank_one() -> nn.Module:
    return SlowOnRankOne()
