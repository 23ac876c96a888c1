"""What a step touches, built from the plan: optimizer, learning-rate schedule, and the
parts bundled for the loop. Runs on workers.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from ray_ddp.config.train import TrainConfig


@dataclass
class TrainParts:
    """What a step touches: the model (bare under DDP, which a checkpoint saves; sharded
    in place under FSDP), its parallel wrapper (the DDP module, or the FSDP model itself),
    what runs the forward pass (the wrapper, or its torch.compile), optimizer, LR
    schedule, scaler, and this worker's devices (whose RNG a checkpoint keeps)."""

    model: nn.Module
    wrapped: nn.Module
    forward: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    devices: list[torch.device]
    grads_in_buckets: bool = False  # DDP's gradient_as_bucket_view

    def zero_grad(self) -> None:
        """Gradients that are views into DDP's buckets are zeroed in place: set to None,
        they are reallocated every step and the bucket view saves nothing (as torch's
        docstring of gradient_as_bucket_view says)."""
        self.optimizer.zero_grad(set_to_none=not self.grads_in_buckets)

    def stateful(self) -> dict:
        return {"scheduler": self.scheduler, "scaler": self.scaler}

    def gradient_sync(self, sync: bool):
        """Whether this micro-batch's backward reduces gradients across the ranks: only
        the last of a step does; the others accumulate locally."""
        if isinstance(self.wrapped, DDP):
            return contextlib.nullcontext() if sync else self.wrapped.no_sync()
        self.wrapped.set_requires_gradient_sync(sync)  # FSDP
        return contextlib.nullcontext()


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9)


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, total: int):
    """Linear warm-up over ``warmup_steps``, then constant or cosine decay to 0 at step
    ``total``, the run's last (which the driver works out: a resume on another world size
    has other steps per epoch from there on)."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "cosine":
            progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
