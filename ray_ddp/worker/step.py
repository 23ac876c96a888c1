"""One optimizer step: ``grad_accum`` micro-batches of this rank's rows, forward and
backward, gradients reduced across the ranks on the last, clipping, the optimizer, the
schedule. Runs on workers.

The loss for backward is the task's summed loss over this rank's share of the step's
units: the strategy's mean over ranks is then the exact mean over the global batch,
however it is split across ranks and micro-batches. The micro-batches of a step are
fetched first, so that a task whose units vary (labels of -100) can count them.

An empty micro-batch (a rank's part of an epoch's leftover rows) never reaches the model,
which may not take 0 rows (GPT-2 cannot reshape them) or may return NaN for them: the
rank runs a real row instead, times 0 (the first it trained on, or the source's stand-in
row when it has trained on none; kept once: no copy on later steps). Every rank still runs the same forwards and
backwards (DDP's gradient hooks, FSDP's gathers are collectives), adding nothing.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ray_ddp.errors import UnusedParametersError
from ray_ddp.tasks.builtin import Task
from ray_ddp.tasks.batches import (batch_rows, count_tokens, first_row, forward, loss_of, to_device,
                                   zero_like_graph)
from ray_ddp.worker.parts import TrainParts
from ray_ddp.worker.window import WindowState


def seed_step(seed: int, rank: int, step: int, devices: Sequence[torch.device] = ()) -> None:
    """Seed this rank's RNG (the CPU's and its own GPUs') for global step ``step`` (from
    1): its draws (dropout, a collator's masks) are a function of the seed, the rank and
    the step, never of what the process drew before, so the state after a step is whole
    without any rank's RNG: a survivor's save (worker/snapshotting.py) goes on as an
    unbroken run would. The generators themselves, not ``torch.manual_seed``, which costs
    some 75 us a call looking for every kind of device."""
    digest = hashlib.blake2b(f"{seed}:{rank}:{step}".encode(), digest_size=8).digest()
    value = int.from_bytes(digest, "little") >> 1
    torch.default_generator.manual_seed(value)
    for index in {d.index for d in devices if d.type == "cuda"}:
        torch.cuda.default_generators[index].manual_seed(value)


def train_step(parts: TrainParts, task: Task, source, window: WindowState, epoch: int, step: int,
               grad_accum: int, clip_grad: float, collective_device: torch.device) -> None:
    in_device, out_device = parts.devices[0], parts.devices[-1]
    parts.zero_grad()
    started = window.busy.start()
    fetching = time.perf_counter()
    batches = [source.micro_batch(epoch, step, micro) for micro in range(grad_accum)]
    window.data_wait_s += time.perf_counter() - fetching
    for x, y, _ in batches:  # on the host: a label out of range is one line, not a device-side assert
        task.check_batch(x, y)
    window.tokens += sum(count_tokens(x) for x, _, _ in batches)
    # the loss is summed over this rank's units and divided by its share of the step's:
    # a fixed number of units per row, or (masked labels) the step's units counted on the
    # host copies and summed over the ranks, as the Hugging Face Trainer does
    if task.variable_units:
        share = count_step_units(task, batches, collective_device) / dist.get_world_size()
    else:
        share = batches[0][2] * task.units_per_row
    window.busy.stop(started)
    for micro, (x, y, _) in enumerate(batches):
        started = window.busy.start()
        if parts.last_row is None and batch_rows(y):
            parts.last_row = first_row(x), first_row(y)
        stand_in = batch_rows(y) == 0 and stand_in_row(parts, source) is not None
        if stand_in:
            x, y = parts.last_row
        x, y = to_device(x, in_device), to_device(y, out_device)
        # only the last micro-batch's backward reduces gradients; the others accumulate
        with parts.no_backward_sync(micro == grad_accum - 1):
            with parts.autocast():
                out = forward(parts.forward, x)
            sums = task.sums(out, y, x)
            if stand_in:  # on the graph, adding nothing (a NaN loss of the row left out)
                loss = zero_like_graph(out, leave_out=loss_of(out))
                sums = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0.0 for k, v in sums.items()}
            else:
                loss = sums["loss"] / share if share else sums["loss"] * 0.0
            window.busy.stop(started)
            parts.scaler.scale(loss).backward()
        window.add(sums, 0 if stand_in else batch_rows(y))  # the window keeps every sum's key
    parts.scaler.unscale_(parts.optimizer)  # the norm of the true gradients (a no-op without fp16)
    window.grad_norm_sum = window.grad_norm_sum + grad_norm(parts.model.parameters(), clip_grad)
    # A step with no unit on any rank (every label -100; ``share`` is the same on every
    # rank) has no data: an optimizer step would still move the weights (AdamW's momentum
    # and weight decay). The schedule still counts it: the step's number is taken.
    if share:
        parts.scaler.step(parts.optimizer)
    parts.scaler.update()
    parts.scheduler.step()
    window.steps += 1


def grad_norm(parameters, clip_grad: float) -> torch.Tensor:
    """The gradients' total norm before clipping (clipped to ``clip_grad`` when > 0), on
    the device: no sync. A sharded model's norm is over every rank's shards (DTensor)."""
    parameters = list(parameters)
    if clip_grad > 0:
        norm = torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    full = getattr(norm, "full_tensor", None)  # a DTensor's norm: the all-reduced whole
    return (full() if full is not None else norm).detach()


def stand_in_row(parts: TrainParts, source) -> Any:
    """A real row for a micro-batch with none (kept in ``parts.last_row``): the first this
    process trained on, else one the source gives (a fresh worker whose first micro-batch
    is empty: a restart at an epoch's last step, a data set smaller than the ranks); None
    where neither has one (the empty batch then reaches the model as it is)."""
    if parts.last_row is None:
        row = source.stand_in()
        if row is not None:
            parts.last_row = first_row(row[0]), first_row(row[1])
    return parts.last_row


def count_step_units(task: Task, batches: list, collective_device: torch.device) -> float:
    """The step's units over every rank and micro-batch: one small all-reduce."""
    local = sum(task.count_units(x, y) for x, y, _ in batches)
    total = torch.tensor([local], dtype=torch.float64, device=collective_device)
    dist.all_reduce(total)
    return float(total.item())


def unused_parameters_error(err: RuntimeError, find_unused_parameters: bool) -> UnusedParametersError | None:
    """DDP's long error for a forward that skipped parameters (raised at the next step's
    forward, on every rank alike), as the one line that names the flag; None for any other."""
    if "find_unused_parameters=True" in str(err) and not find_unused_parameters:
        return UnusedParametersError("the model's forward did not use every parameter, and DDP needs each "
                                     "one's gradient for its all-reduce; pass --find-unused-parameters")
    return None
