"""What a step touches, built from the plan: the model set up by the strategy, its
optimizer, learning-rate schedule and scaler, with the checkpoint loaded. Runs on
workers."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ray_ddp.checkpoint.format import TrainState
from ray_ddp.checkpoint.resume import load_checkpoint_to_resume
from ray_ddp.config.train import TrainConfig
from ray_ddp.models.build import build_model
from ray_ddp.models.init import apply_init_weights, holds_adapters, read_init_weights
from ray_ddp.parallel.materialize import META, rank0_builds
from ray_ddp.parallel.strategy import Strategy
from ray_ddp.plan import RunPlan, WorkerPlan


@dataclass
class TrainParts:
    """What a step touches: the model (bare under DDP, which a checkpoint saves; sharded
    in place under FSDP), what the forward and backward run through (the strategy's
    wrapper, or its torch.compile), optimizer, LR schedule, scaler, this worker's devices
    (whose RNG a checkpoint keeps) and the strategy."""

    model: nn.Module
    wrapped: nn.Module
    forward: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    devices: list[torch.device]
    strategy: Strategy
    # a real row of this rank (inputs, targets), its first: what an empty micro-batch runs instead
    last_row: Any = None

    def zero_grad(self) -> None:
        self.strategy.zero_grad(self.optimizer)

    def no_backward_sync(self, sync: bool):
        return self.strategy.no_backward_sync(self.wrapped, sync)

    def autocast(self):
        dtype = self.strategy.autocast_dtype()
        return torch.autocast(self.devices[0].type, dtype=dtype, enabled=dtype is not None)

    def stateful(self) -> dict:
        return {"scheduler": self.scheduler, "scaler": self.scaler}


def build_parts(plan: WorkerPlan, strategy: Strategy, devices: list[torch.device],
                given_model: Any, latest_checkpoint: Any = None, node_id: Any = None
                ) -> tuple[TrainParts, TrainState]:
    """The model on the strategy's devices, set up for the ranks, its optimizer, schedule
    and scaler, and the checkpoint loaded into them (``TrainState()`` for a new run).
    The checkpoint, loaded into the bare model after wrapping (the parameters are the same
    tensors), makes the weights the saved ones: the plan's, or ``latest_checkpoint``, the
    one Ray hands back after a restart within the run."""
    cfg = plan.run.config
    model, wrapped = build_model_on_ranks(plan.run, strategy, devices, given_model, plan.init_from, plan.init_strict)
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer, plan.total_steps)
    scaler = torch.amp.GradScaler(devices[0].type, enabled=cfg.amp == "fp16")
    parts = TrainParts(model, wrapped, torch.compile(wrapped) if cfg.compile else wrapped,
                       optimizer, scheduler, scaler, devices, strategy)
    state = load_checkpoint_to_resume(cfg, plan.run.folder, plan.resume_from, plan.newest_at_start,
                                      latest_checkpoint, strategy, model, optimizer, parts.stateful(), node_id,
                                      plan.snapshot_scope)
    return parts, state


def build_model_on_ranks(run: RunPlan, strategy: Strategy, devices: list[torch.device], given_model: Any,
                         init_from: Optional[str] = None, init_strict: bool = True) -> tuple[nn.Module, nn.Module]:
    """(the bare model, what the strategy wrapped it in) with a new run's first weights:
    the seed's, or ``init_from``'s. With more than one rank only rank 0 builds the weights
    and reads ``init_from``; the others build the shapes on the meta device and the
    strategy gives them rank 0's values (parallel/materialize.py)."""
    cfg = run.config
    torch.manual_seed(cfg.seed)
    from_rank0 = rank0_builds(cfg, given_model, dist.get_world_size())
    shapes_only = from_rank0 and dist.get_rank() != 0
    # rank 0 checks the keys and shapes (the driver did too), then streams the values in
    shapes = read_init_weights(init_from, shapes_only=True) if init_from is not None and not shapes_only else None

    def init(model: nn.Module) -> None:  # a new run's first weights (before --lora, unless they hold adapters)
        apply_init_weights(model, init_from, init_strict, shapes)

    build_devices = strategy.build_devices(devices)
    with torch.device(META) if shapes_only else contextlib.nullcontext():
        model = build_model(run, [META] * len(build_devices) if shapes_only else build_devices, given_model,
                            init=init if shapes is not None else None,
                            init_adapters=shapes is not None and holds_adapters(shapes))
    if cfg.sync_batchnorm:  # before DDP wraps it: statistics over the global batch
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model, strategy.setup_module(model, devices, from_rank0)  # before the optimizer: FSDP's shards


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
