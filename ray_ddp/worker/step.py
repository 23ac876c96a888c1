"""One optimizer step: ``grad_accum`` micro-batches of this rank's rows, forward and
backward, gradients reduced across the ranks on the last, clipping, the optimizer, the
schedule. Runs on workers.

The loss for backward is the task's summed loss over this rank's share of the step's
units: the strategy's mean over ranks is then the exact mean over the global batch,
however it is split across ranks and micro-batches.
"""

from __future__ import annotations

import torch

from ray_ddp.tasks import Task, batch_rows, forward, to_device
from ray_ddp.worker.parts import TrainParts
from ray_ddp.worker.window import WindowState


def train_step(parts: TrainParts, task: Task, source, window: WindowState, epoch: int, step: int,
               grad_accum: int, clip_grad: float) -> None:
    in_device, out_device = parts.devices[0], parts.devices[-1]
    parts.zero_grad()
    for micro in range(grad_accum):
        started = window.busy.start()
        x, y, share = source.micro_batch(epoch, step, micro)
        x, y = to_device(x, in_device), to_device(y, out_device)
        # only the last micro-batch's backward reduces gradients; the others accumulate
        with parts.no_backward_sync(micro == grad_accum - 1):
            with parts.autocast():
                out = forward(parts.forward, x)
            sums = task.sums(out, y)
            loss = sums["loss"] / (share * task.units_per_row)
            window.busy.stop(started)
            parts.scaler.scale(loss).backward()
        window.add(sums, batch_rows(y))
    if clip_grad > 0:
        parts.scaler.unscale_(parts.optimizer)
        torch.nn.utils.clip_grad_norm_(parts.model.parameters(), clip_grad)
    parts.scaler.step(parts.optimizer)
    parts.scaler.update()
    parts.scheduler.step()
    window.steps += 1
