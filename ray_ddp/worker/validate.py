"""Validation: every rank evaluates its contiguous part of the validation rows under
eval() and no_grad(), and one all-reduce of the task's sums gives the exact figures
over every row, counted once; and ``--early-stop``: the validations in a row without a
lower val_loss, counted the same on every rank (each sees the same all-reduced figure).
Runs on workers.

Under FSDP every rank runs as many validation batches (each forward gathers the shards:
a collective), so a rank whose part is shorter ends with an empty batch; a model may not
take 0 rows (GPT-2 cannot reshape them), so the rank runs a real row in its place (the
first of its own validation rows, else its training stand-in) and adds none of its sums."""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from ray_ddp.data.inputs import ValSet
from ray_ddp.tasks.builtin import Task
from ray_ddp.tasks.batches import batch_rows, first_row, forward, to_device
from ray_ddp.worker.parts import TrainParts
from ray_ddp.storage import read_table
from ray_ddp.record.folder import RunFolder


class Validator:
    """Decides when to validate (every ``--eval-every`` epochs and after the last, every
    ``--eval-every-steps`` steps), does it, and with
    ``--early-stop`` whether training should stop (``stopped``)."""

    def __init__(self, cfg, val_set: Optional[ValSet], task: Task, parts: TrainParts, rank: int,
                 world_size: int, collective_device: torch.device,
                 on_batch: Callable[[], None] = lambda: None, folder: Optional[RunFolder] = None):
        self.cfg, self.val_set, self.task, self.parts = cfg, val_set, task, parts
        self.folder = folder  # the run's folder: eval.parquet, where --early-stop's count is kept
        self.on_batch = on_batch  # the hang watch's heartbeat: a long validation is progress
        self.rank, self.world_size, self.collective_device = rank, world_size, collective_device
        self.early_stop = EarlyStop(cfg.early_stop) if cfg.early_stop else None

    @property
    def stopped(self) -> bool:
        """--early-stop's count has been reached: the loop ends (the same on every rank)."""
        return self.early_stop is not None and self.early_stop.stopped

    def resume_early_stop(self, step: int, unsent: Sequence[list[dict[str, Any]]] = ()) -> None:
        """Put back --early-stop's count on a resume from global step ``step``: replay the
        run's earlier validations (eval.parquet, the rows up to that step: the history of
        the checkpoint that was loaded), and those among the metrics rows the loaded state
        holds unsent (``unsent``: each rank's; a snapshot's, whose validations reached no
        table yet). Rank 0 reads the table and hands the rows on, so every rank counts
        from the same history even if the file changes meanwhile."""
        if self.early_stop is None or step == 0:
            return
        rows = [read_eval_history(self.folder, step) if self.rank == 0 else None]
        dist.broadcast_object_list(rows, src=0)
        by_step = {r["step"]: r for r in rows[0]}
        by_step.update({r["step"]: {"epoch": r["epoch"], "step": r["step"], "loss": r["val_loss"]}
                        for r in (unsent[0] if unsent else []) if r.get("val_loss") is not None})
        self.early_stop.replay(by_step.values())

    def should_validate(self, epoch_done: int, step: int) -> bool:
        """At an epoch's end (``epoch_done`` > 0: every --eval-every epochs and after the
        last), and every --eval-every-steps global steps. Not at a --max-steps end of its
        own: a run continued with a larger --max-steps validates (and counts --early-stop)
        where one that never stopped does."""
        cfg = self.cfg
        if self.val_set is None:
            return False
        by_epoch = epoch_done > 0 and (epoch_done % cfg.eval_every == 0 or epoch_done == cfg.epochs)
        return by_epoch or bool(cfg.eval_every_steps and step % cfg.eval_every_steps == 0)

    def validate(self, epoch_done: int = 0) -> dict:
        """The validation figures as metrics columns (``val_loss``, ...), the same on
        every rank, and its time (``val_time_s``); with --early-stop, also whether it
        stops the run after epoch ``epoch_done`` (``early_stopped`` and the figures the
        driver's line names)."""
        started = time.perf_counter()
        model, task, parts = self.parts.model, self.task, self.parts
        modes = [(m, m.training) for m in model.modules()]  # a frozen BatchNorm stays frozen
        model.eval()
        totals: dict[str, torch.Tensor] = {}
        batches = self.val_set.batches(self.rank, self.world_size, self.cfg.batch_size,
                                       equal_counts=parts.strategy.forward_is_collective)
        real_row = parts.last_row  # a stand-in for an empty batch: the training's, until a real one
        with torch.no_grad():
            for x, y in batches:
                stand_in = batch_rows(y) == 0 and real_row is not None
                if stand_in:
                    x, y = real_row
                elif batch_rows(y) and real_row is parts.last_row:
                    real_row = first_row(x), first_row(y)
                if not stand_in:  # on the host, as in training
                    task.check_batch(x, y)
                x, y = to_device(x, parts.devices[0]), to_device(y, parts.devices[-1])
                with parts.autocast():
                    out = forward(model, x)
                if not stand_in:
                    for key, value in task.sums(out, y, x).items():
                        totals[key] = totals.get(key, 0) + (value.double() if torch.is_tensor(value) else value)
                self.on_batch()
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
        if self.early_stop is not None:
            result.update(self.early_stop.update(result["val_loss"], epoch_done))
        return result


class EarlyStop:
    """--early-stop N: the best val_loss so far and how many validations in a row did
    not lower it; ``stopped`` once that count reaches N. A val_loss equal to the best does
    not lower it, and neither does a NaN."""

    def __init__(self, patience: int):
        self.patience = patience
        self.best = math.inf
        self.best_epoch: Optional[int] = None  # epochs done at the best validation
        self.stale = 0  # validations in a row since the best

    @property
    def stopped(self) -> bool:
        return self.stale >= self.patience

    def update(self, val_loss: float, epoch_done: int) -> dict[str, Any]:
        """Count one validation; the metrics row's early-stop columns."""
        if val_loss < self.best:
            self.best, self.best_epoch, self.stale = val_loss, epoch_done, 0
        else:
            self.stale += 1
        return {"early_stopped": self.stopped, "early_stop_stale": self.stale,
                "early_stop_best": self.best if self.best_epoch is not None else None,
                "early_stop_best_epoch": self.best_epoch}

    def replay(self, history: Iterable[dict[str, Any]]) -> None:
        """Count eval.parquet's rows (``epoch``, ``loss``) in step order, as they came."""
        for row in sorted(history, key=lambda r: r["step"]):
            self.update(row["loss"], row["epoch"])


def read_eval_history(folder: RunFolder, step: int) -> list[dict[str, Any]]:
    """eval.parquet's rows up to global step ``step`` (later rows belong to checkpoints
    that were not resumed from: a redone stretch replaces them)."""
    table = read_table(folder.fs, folder.evals)
    rows = table.select(["epoch", "step", "loss"]).to_pylist() if table is not None else []
    return [r for r in rows if r["step"] <= step]
