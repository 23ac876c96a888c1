"""Checks a rank makes before it reports or saves: weights still finite, and buffers
the same on every rank. Runs on workers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def broadcast_buffers(model: nn.Module, collective_device: torch.device) -> None:
    """Give every rank rank 0's buffers (BatchNorm's running statistics). Each rank's
    forward updates its own from its own rows, so they drift apart within a step; DDP
    broadcasts rank 0's at each forward, and this does the same before validation and a
    checkpoint, so every rank validates with, and hashes, the buffers rank 0 saves."""
    if dist.get_world_size() == 1:
        return
    for buffer in model.buffers():
        if hasattr(buffer, "to_local"):
            continue  # a DTensor: FSDP keeps it consistent itself
        if buffer.device == collective_device:
            dist.broadcast(buffer, src=0)
        else:  # gloo on CPU for buffers on a GPU (a two-stage model on gloo, never NCCL)
            staged = buffer.to(collective_device)
            dist.broadcast(staged, src=0)
            buffer.copy_(staged)


def weights_are_finite(model: nn.Module) -> bool:
    """Whether every floating tensor of the state (weights, BatchNorm statistics) is finite:
    checked before a checkpoint, since the loss is computed before the update that may
    have made them infinite."""
    # FSDP: this rank's shard (agree() ORs the ranks)
    local = [t.to_local() if hasattr(t, "to_local") else t for t in model.state_dict().values()]
    floats = [t.detach() for t in local if t.is_floating_point()]
    per_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in floats:
        # a sum is finite when every term is (a NaN or inf carries into it): one read of
        # the weights, no mask as big as them (0.02 s for 50M parameters here, not 0.3)
        wide = torch.float64 if t.dtype == torch.float64 else torch.float32
        per_device.setdefault(t.device, []).append(t.sum(dtype=wide).isfinite())
    if all(bool(torch.stack(flags).all()) for flags in per_device.values()):  # a sync per device
        return True
    # a non-finite sum: an inf or NaN, or finite values whose sum overflowed; look closer
    return all(bool(torch.isfinite(t).all()) for t in floats)
