"""Rank 0's checkpoint writer: the training thread copies the state into host memory, and
Ray's upload thread writes that copy into run storage while training goes on. Runs on a
worker (rank 0).

The copy's memory is reused by the next checkpoint (hundreds of MB are not allocated
again at every epoch) only once its own upload has succeeded: Ray retries a failed upload
with the same copy, and a copy refilled meanwhile would write a torn file whose CRC-32
(counted from the bytes as they go out) still matched.

"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Optional
import pyarrow.fs as pafs
from torch import nn
import torch
from ray_ddp.checkpoint.format import CheckpointSnapshot, TrainState, snapshot_checkpoint, write_checkpoint


class CheckpointTimings:
    """What the newest checkpoint cost, until a metrics row takes it: the seconds its copy
    stalled training (``checkpoint_save_s``, the wait for the previous upload included)
    and its write took (``checkpoint_upload_s``, noted on Ray's upload thread: a lock)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}

    def note(self, key: str, started: float) -> None:
        with self._lock:
            self._seconds[key] = time.perf_counter() - started

    def take(self) -> dict[str, float]:
        """Each figure once, for the next row."""
        with self._lock:
            taken, self._seconds = self._seconds, {}
        return taken


class CheckpointWriter:
    """Snapshots on the training thread, writes on the upload thread, one at a time."""

    def __init__(self, fs: pafs.FileSystem, path_for: Callable[[str], str]):
        self.fs, self.path_for = fs, path_for
        self._idle = threading.Event()  # set while the newest snapshot's upload is not running
        self._idle.set()
        self._latest: Optional[CheckpointSnapshot] = None
        self._reusable: Optional[CheckpointSnapshot] = None  # written for good: free memory
        self.timings = CheckpointTimings()

    def idle(self) -> bool:
        return self._idle.is_set()

    def snapshot(self, model: nn.Module, optimizer: torch.optim.Optimizer, stateful: dict[str, Any],
                 state: TrainState, run: dict[str, Any], dir_name: str, final: bool,
                 rows: Optional[list] = None) -> CheckpointSnapshot:
        """Wait for the previous upload (the only wait training has), then copy the state
        (rank 0's: the writer's; the whole model is always in it, whatever ``final``), with
        ``rows``, every rank's metrics rows its report sends."""
        started = time.perf_counter()
        self._idle.wait()
        self._idle.clear()
        reuse, self._reusable = self._reusable, None
        self._latest = snapshot_checkpoint(model, optimizer, state, run, 0, stateful, reuse=reuse)
        if rows:
            self._latest.train_state["rows"] = rows
        self.timings.note("checkpoint_save_s", started)
        return self._latest

    def write(self, snapshot: CheckpointSnapshot, dir_name: str) -> str:
        """Write ``snapshot`` into the run's ``dir_name`` folder; returns its path. Called
        on Ray's upload thread, perhaps again for the same snapshot when Ray retries."""
        try:
            _lower_thread_priority()  # the training thread comes first for the CPU
            started = time.perf_counter()
            path = self.path_for(dir_name)
            write_checkpoint(path, snapshot, self.fs)
            self.timings.note("checkpoint_upload_s", started)
        except BaseException:
            self._finished(snapshot)  # not reusable: a retry may still read it
            raise
        self._reusable = snapshot
        self._finished(snapshot)
        return path

    def _finished(self, snapshot: CheckpointSnapshot) -> None:
        if snapshot is self._latest:  # a late retry of an older one says nothing of the newest
            self._idle.set()


def _lower_thread_priority() -> None:
    """Raise this thread's nice value (Linux sets it per thread); anywhere else, or if
    refused, leave it as it is."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass
