"""Strategy: everything that differs between DDP and FSDP, behind one interface, so the
loop calls it and never branches on which it is (Lightning Fabric's strategies are the
model). Runs on workers.

A strategy decides where the model is built, how it is wrapped for the ranks, whether a
micro-batch's backward reduces gradients, how gradients are zeroed, whether autocast is
needed, whether a forward is a collective (so every rank runs as many), and who writes
a checkpoint, how, and how it is loaded again.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ray_ddp.parallel.materialize import broadcast_buffers

_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Strategy:
    """The interface, with what both share."""

    name = ""
    # whether a forward gathers from every rank (validation then gives each rank as many
    # batches, the shorter parts ending with an empty one)
    forward_is_collective = False
    # how its checkpoints hold the model: "whole" (rank 0's model.pt) or "sharded" (every
    # rank's shards); the checkpoint header says which (checkpoint/format.py)
    checkpoint_format = "whole"

    def __init__(self, cfg):
        self.cfg = cfg

    def build_devices(self, devices: Sequence[torch.device]) -> list[torch.device]:
        """Where the model is built before ``setup_module``."""
        return list(devices)

    def setup_module(self, model: nn.Module, devices: Sequence[torch.device], from_rank0: bool = False) -> nn.Module:
        """The module the forward and backward run through (the model may change in place).
        ``from_rank0``: only rank 0 built the weights, the others the shapes on the meta
        device (parallel/materialize.py); the strategy gives every rank rank 0's values."""
        raise NotImplementedError

    def no_backward_sync(self, wrapped: nn.Module, sync: bool) -> ContextManager:
        """Whether this micro-batch's backward reduces gradients across the ranks: only the
        last of a step does; the others accumulate locally."""
        raise NotImplementedError

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Gradients set to None. Under DDP's gradient_as_bucket_view the next backward puts
        each one back into its bucket (the same memory every step), so zeroing in place
        would only add a write of every gradient (benchmarks/zero_grad.py measures both)."""
        optimizer.zero_grad(set_to_none=True)

    def autocast_dtype(self) -> Optional[torch.dtype]:
        """The dtype of the forward's autocast, None for none."""
        return _AMP_DTYPES.get(self.cfg.amp)

    def checkpoint_writer(self, session, rank: int):
        """This rank's checkpoint writer (into the session's run storage: its ``fs`` and
        ``checkpoint_path``), or None for a rank that writes nothing."""
        raise NotImplementedError

    def load_checkpoint(self, directory: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                        stateful: dict[str, Any]):
        """Load a checkpoint folder of this strategy's format (its files already checked
        against meta.json) into the model, optimizer and ``stateful``; its TrainState."""
        raise NotImplementedError

    def sync_buffers(self, model: nn.Module, collective_device: torch.device) -> None:
        """Give every rank rank 0's buffers (BatchNorm's running statistics). Each rank's
        forward updates its own from its own rows, so they drift apart within a step; DDP
        broadcasts rank 0's at each forward, and this does the same before validation and
        a checkpoint, so every rank validates with, and hashes, the buffers rank 0 saves."""
        if dist.get_world_size() > 1:
            broadcast_buffers(model, collective_device)


def no_context() -> ContextManager:
    return contextlib.nullcontext()
