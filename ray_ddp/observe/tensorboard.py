"""``--tensorboard``: the metrics as TensorBoard event files. Runs in Ray Train's
controller.
"""

from __future__ import annotations

from typing import Any
from ray_ddp.observe.schema import rank_mean


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
