"""What the ranks of a process group agree on before they load a state: a flag every rank
must raise, a value reduced over them, on the device the group's backend needs. Runs on
workers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def collective_device() -> torch.device:
    """Where a tensor for the group's backend lives (NCCL: this rank's GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduced(value: float, op) -> float:
    """``value`` reduced over every rank by ``op`` (one all-reduce)."""
    tensor = torch.tensor([float(value)], device=collective_device())
    dist.all_reduce(tensor, op=op)
    return tensor.item()


def usable_on_every_rank(usable: bool) -> bool:
    """Whether every rank of the process group says ``usable`` (one all-reduce; just
    ``usable`` outside a group)."""
    if not dist.is_initialized():
        return usable
    return bool(reduced(1.0 if usable else 0.0, dist.ReduceOp.MIN))
