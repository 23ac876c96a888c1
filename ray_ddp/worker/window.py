"""A metrics window: what a rank did since its previous report (the task's sums kept on
the device, its own work time). Runs on workers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional
import torch

from ray_ddp.worker.devices import peak_memory_mb
from ray_ddp.worker.flops import model_flops_utilization


class BusyClock:
    """Seconds this rank spends on its own work (data and forward pass), outside the
    gradient all-reduce in backward, where every rank waits for the slowest: in DDP the
    wall time per step is the same on every rank, so this is what shows a straggler.
    CUDA events time GPU work without a sync per step (one sync when read)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self.pending: list = []

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((started, end))
        else:
            self.seconds += time.perf_counter() - started

    def read(self) -> float:
        if self.pending:
            self.pending[-1][1].synchronize()
            self.seconds += sum(a.elapsed_time(b) for a, b in self.pending) / 1000.0
            self.pending.clear()
        return self.seconds


@dataclass
class WindowState:
    """What this rank did since its previous report: the task's sums (loss over units,
    units, correct predictions), kept on the device so a step never waits for them."""

    sums: dict[str, torch.Tensor]
    busy: BusyClock
    steps: int = 0
    samples: int = 0
    tokens: int = 0  # input tokens (token tasks; 0 otherwise): tasks/batches.py count_tokens
    data_wait_s: float = 0.0  # time the steps waited for their micro-batches
    started: float = 0.0
    # set (on the device, no sync) once any micro-batch's loss was NaN or infinite
    loss_bad: Optional[torch.Tensor] = None
    grad_norm_sum: Any = 0.0  # each step's gradient norm before clipping, on the device

    @classmethod
    def start(cls, device: torch.device, out_device: torch.device, at: Optional[float] = None) -> "WindowState":
        return cls(sums={}, busy=BusyClock(device), started=time.perf_counter() if at is None else at,
                   loss_bad=torch.zeros((), dtype=torch.bool, device=out_device))

    def add(self, sums: dict[str, torch.Tensor], rows: int) -> None:
        """One micro-batch's sums (detached, on the device: no sync)."""
        for key, value in sums.items():
            self.sums[key] = self.sums.get(key, 0) + (value.detach() if torch.is_tensor(value) else value)
        self.loss_bad |= ~torch.isfinite(sums["loss"].detach())
        self.samples += rows


def window_row(window: WindowState, task, ended: float, *, epoch: int, step: int, rank: int,
               world_size: int, node_rank: int, node_id: str, lr: float, device: torch.device,
               flops: tuple[float, Optional[float]] = (0.0, None)) -> dict:
    """This rank's metrics.parquet row for a window that ended at ``ended``; ``flops``:
    the model's FLOPs per token and its devices' peak (worker/flops.py), for ``mfu``."""
    elapsed = ended - window.started
    totals = {k: float(v) for k, v in window.sums.items()}  # one device sync per window, not per step
    tokens_per_s = window.tokens / elapsed if window.tokens and elapsed > 0 else None
    figures = {
        "tokens": window.tokens or None, "tokens_per_s": tokens_per_s,
        "data_wait_s": window.data_wait_s, "data_wait_share": window.data_wait_s / elapsed if elapsed > 0 else None,
        "grad_norm": float(window.grad_norm_sum) / window.steps if window.steps else None,
        "mfu": model_flops_utilization(tokens_per_s, *flops),
    }
    return {**figures,
        "epoch": epoch + 1, "step": step, "rank": rank, "node_rank": node_rank, "node_id": node_id,
        "world_size": world_size, **task.metrics(totals), "samples": window.samples,
        "step_time_s": elapsed, "busy_s": window.busy.read(),
        "samples_per_s": window.samples / elapsed if elapsed > 0 else 0.0,
        "time": time.time(), "lr": lr, "units": totals.get("units", 0.0), **peak_memory_mb(device),
    }
