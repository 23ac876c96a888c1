"""A model for test_hangs.py's replaced-group story: HangsOnSchedule (user_models.py)
whose first hang's handling outlives the worker group. Built on workers (and once on the
driver, for its checks: not a life there)."""

from __future__ import annotations

import os
import threading
import time

from torch import nn
from user_models import HangsOnSchedule

# Seconds the second life's rank 0 waits, after its first step, before it reads the
# stalled write: several heartbeats (every second under --hang-timeout 10) of the new
# group reach the watch first, while the watch still handles the first hang.
READ_AFTER_S = 5.0


class StallsTheWatch(HangsOnSchedule):
    """HangsOnSchedule whose first life's rank 1 makes ``fifo`` (the first hang's
    ``hangs/<step>/rank-0.txt``) a named pipe at its first step: the watch's write of
    that hang's stacks blocks there, as on a storage that stalls, until a reader opens
    it. Meanwhile rank 0's collective times out and Ray Train restarts the group. The
    second life's rank 0 is the reader, ``READ_AFTER_S`` after its first step, and keeps
    what it read in ``<folder>/read-stacks.txt``."""

    def __init__(self, folder: str, hangs: tuple, fifo: str):
        super().__init__(folder, hangs)
        self.fifo = fifo
        self.life = self._count_lives() if self.rank is not None else None

    def _count_lives(self) -> int:
        with open(os.path.join(self.folder, f"lives-{self.rank}")) as f:
            return len(f.read().splitlines())

    def forward(self, x):
        if self.training and self.calls == 0:  # this life's first step
            if self.life == 1 and self.rank == 1 and not os.path.exists(self.fifo):
                os.makedirs(os.path.dirname(self.fifo), exist_ok=True)
                os.mkfifo(self.fifo)
            elif self.life == 2 and self.rank == 0:
                threading.Thread(target=self._read_the_stalled_write, daemon=True).start()
        return super().forward(x)

    def _read_the_stalled_write(self) -> None:
        time.sleep(READ_AFTER_S)
        with open(self.fifo, "rb") as f:  # the watch's write, blocked until now, goes on
            text = f.read()
        with open(os.path.join(self.folder, "read-stacks.txt"), "wb") as out:
            out.write(text)


def release_stalled_write(fifo: str) -> None:
    """Open ``fifo`` for reading and close it at once: a write still blocked on it (the
    story went wrong) fails instead of holding the driver's hang watch forever."""
    try:
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    except OSError:
        pass


def stalls_the_watch(folder: str, hangs: tuple, fifo: str) -> nn.Module:
    return StallsTheWatch(folder, hangs, fifo)
