"""An I/O-bound map-style Dataset for benchmarks/loader.py: every item waits, as a read
from network storage does, then returns a row of a fixed regression problem. Imported
by both arms (a torchrun rank, and ray-ddp's ``--dataset slow_reads:slow_reads``); its
size and wait come from the environment, which both arms' processes inherit:
SLOW_READS_ROWS, SLOW_READS_WAIT_MS, SLOW_READS_DIM.
"""

from __future__ import annotations

import os
import time

import torch
from torch.utils.data import Dataset


class SlowReads(Dataset):
    def __init__(self, rows: int, dim: int, wait_s: float, outputs: int = 4, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(rows, dim, generator=g)
        self.y = self.x @ torch.randn(dim, outputs, generator=g) / dim ** 0.5
        self.wait_s = wait_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        time.sleep(self.wait_s)  # the read: the core is free meanwhile, as on network storage
        return self.x[i], self.y[i]


def slow_reads() -> SlowReads:
    return SlowReads(int(os.environ.get("SLOW_READS_ROWS", "4096")), int(os.environ.get("SLOW_READS_DIM", "64")),
                     float(os.environ.get("SLOW_READS_WAIT_MS", "2")) / 1000)
