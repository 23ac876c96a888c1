"""``--tensorboard``: the metrics as TensorBoard event files in <run>/tensorboard/. Runs in
Ray Train's controller.
"""

from __future__ import annotations

from typing import Any

from ray_ddp.trackers.base import Tracker, Window
from ray_ddp.record.schema import rank_mean


class TensorBoardTracker(Tracker):
    """Each rank's loss and throughput, the means over ranks and the validations; the
    writer is opened in the controller (it holds a thread: it never travels)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.label = f"TensorBoard in {run_dir}/tensorboard"
        self._writer = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_writer": None}

    def log_window(self, window: Window) -> None:
        if self._writer is None:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(logdir=f"{self.run_dir}/tensorboard")
        write_tensorboard_rows(self._writer, window.rows)

    def close(self) -> None:
        """tensorboardX writes from a queue in a thread; flush() does not drain the queue,
        close() does: without it the last report's events are lost with the controller."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def write_tensorboard_rows(writer, metrics: list[dict[str, Any]]) -> None:
    step = int(metrics[0]["step"])
    for m in metrics:
        for key in ("loss", "samples_per_s", "step_time_s", "busy_s"):
            writer.add_scalar(f"{key}/rank_{m['rank']}", m[key], step)
    for key in ("loss", "accuracy", "perplexity"):
        mean = rank_mean(metrics, key)
        if mean is not None:
            writer.add_scalar(f"{key}/mean", mean, step)
    for key in ("val_loss", "val_accuracy", "val_perplexity"):  # the same on every rank
        if metrics[0].get(key) is not None:
            writer.add_scalar(f"validation/{key[4:]}", metrics[0][key], step)
    writer.add_scalar("samples_per_s/total", sum(m["samples_per_s"] for m in metrics), step)
    writer.flush()
