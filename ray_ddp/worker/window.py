"""A metrics window: what a rank did since its previous report (the task's sums kept on
the device, its own work time). Runs on workers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional
import torch


class _BusyClock:
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
class _Window:
    """What this rank did since its previous report: the task's sums (loss over units,
    units, correct predictions), kept on the device so a step never waits for them."""

    sums: dict[str, torch.Tensor]
    busy: _BusyClock
    steps: int = 0
    samples: int = 0
    started: float = 0.0
    # set (on the device, no sync) once any micro-batch's loss was NaN or infinite
    loss_bad: Optional[torch.Tensor] = None
