"""Validation: every rank evaluates its contiguous part of the validation rows under
eval() and no_grad(), and one all-reduce of the task's sums gives the exact figures
over every row, counted once. Runs on workers."""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from ray_ddp.data.inputs import ValSet
from ray_ddp.tasks import Task, forward, to_device
from ray_ddp.worker.parts import TrainParts


class Validator:
    """Decides when to validate (every ``--eval-every`` epochs and after the last) and
    does it."""

    def __init__(self, cfg, val_set: Optional[ValSet], task: Task, parts: TrainParts, rank: int,
                 world_size: int, collective_device: torch.device):
        self.cfg, self.val_set, self.task, self.parts = cfg, val_set, task, parts
        self.rank, self.world_size, self.collective_device = rank, world_size, collective_device

    def should_validate(self, epoch_done: int) -> bool:
        cfg = self.cfg
        return self.val_set is not None and (epoch_done % cfg.eval_every == 0 or epoch_done == cfg.epochs)

    def validate(self) -> dict:
        """The validation figures as metrics columns (``val_loss``, ...), the same on
        every rank, and its time (``val_time_s``)."""
        started = time.perf_counter()
        model, task, parts = self.parts.model, self.task, self.parts
        modes = [(m, m.training) for m in model.modules()]  # a frozen BatchNorm stays frozen
        model.eval()
        totals: dict[str, torch.Tensor] = {}
        batches = self.val_set.batches(self.rank, self.world_size, self.cfg.batch_size,
                                       equal_counts=parts.strategy.forward_is_collective)
        with torch.no_grad():
            for x, y in batches:
                x, y = to_device(x, parts.devices[0]), to_device(y, parts.devices[-1])
                with parts.autocast():
                    out = forward(model, x)
                for key, value in task.sums(out, y).items():
                    totals[key] = totals.get(key, 0) + (value.double() if torch.is_tensor(value) else value)
        for module, training in modes:
            module.train(training)
        keys = ("loss", "units", "correct")
        flat = torch.tensor([float(totals.get(k, 0.0)) for k in keys], dtype=torch.float64,
                            device=self.collective_device)
        dist.all_reduce(flat)
        summed = dict(zip(keys, flat.tolist()))
        result = {f"val_{k}": v for k, v in task.metrics(summed).items()}
        result.update(val_samples=int(round(summed["units"] / task.units_per_row)),
                      val_time_s=time.perf_counter() - started)
        return result
