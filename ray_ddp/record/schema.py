"""The metrics table's schema (one row per rank per window), the validation table's,
and how a report's rows are read: every mean over ranks weighted by units. Runs in
Ray Train's controller and on the driver.
"""

from __future__ import annotations

from typing import Any, Optional
import pyarrow as pa


# The columns every row has, in order; the issue names the first eight.
COLUMNS = ("epoch", "step", "rank", "loss", "samples", "step_time_s", "samples_per_s", "time", "busy_s",
           "world_size", "node_rank", "node_id", "lr", "weights_hash", "loaded_hash", "max_rss_mb",
           "gpu_max_mb", "started_at", "first_step_at", "accuracy", "perplexity", "preempted_node",
           "preemption_deadline", "units", "early_stopped", "tokens", "tokens_per_s", "data_wait_s",
           "data_wait_share", "grad_norm", "mfu", "checkpoint_save_s", "checkpoint_upload_s",
           "setup_max_rss_mb", "setup_gpu_max_mb")


SCHEMA = pa.schema([
    ("epoch", pa.int64()), ("step", pa.int64()), ("rank", pa.int64()), ("loss", pa.float64()),
    ("samples", pa.int64()), ("step_time_s", pa.float64()), ("samples_per_s", pa.float64()),
    ("time", pa.float64()), ("busy_s", pa.float64()), ("world_size", pa.int64()), ("node_rank", pa.int64()),
    ("node_id", pa.string()), ("lr", pa.float64()),
    ("weights_hash", pa.int64()), ("loaded_hash", pa.int64()),
    ("max_rss_mb", pa.float64()), ("gpu_max_mb", pa.float64()),
    ("started_at", pa.float64()), ("first_step_at", pa.float64()),
    ("accuracy", pa.float64()), ("perplexity", pa.float64()),
    # on the row whose checkpoint a preemption notice caused: the drained nodes, the deadline
    ("preempted_node", pa.string()), ("preemption_deadline", pa.float64()),
    # the loss's units in the window (rows; tokens for a language model): the weight of
    # this rank's loss in a mean over ranks
    ("units", pa.float64()),
    # on an epoch end's validation row with --early-stop: whether it ended the run (empty
    # on other rows and without --early-stop)
    ("early_stopped", pa.bool_()),
    # input tokens of a token task's window (null otherwise) and their rate
    ("tokens", pa.int64()), ("tokens_per_s", pa.float64()),
    # time the window's steps waited for their micro-batches, and its share of the window
    ("data_wait_s", pa.float64()), ("data_wait_share", pa.float64()),
    # the window's mean gradient norm before clipping; model FLOPs utilisation (GPU, token tasks)
    ("grad_norm", pa.float64()), ("mfu", pa.float64()),
    # on a writing rank's first row after a checkpoint: the training thread's stall for its
    # copy (the wait for the previous upload included), and its write into run storage
    # (on a later row if it was still writing)
    ("checkpoint_save_s", pa.float64()), ("checkpoint_upload_s", pa.float64()),
    # on a group's first row: max_rss_mb and gpu_max_mb when the model, optimizer and
    # checkpoint were ready, before the first step (what a rank's start-up took)
    ("setup_max_rss_mb", pa.float64()), ("setup_gpu_max_mb", pa.float64()),
])


# eval.parquet: one row per validation (every rank reports the same all-reduced figures)
EVAL_SCHEMA = pa.schema([
    ("epoch", pa.int64()), ("step", pa.int64()), ("samples", pa.int64()), ("loss", pa.float64()),
    ("accuracy", pa.float64()), ("perplexity", pa.float64()), ("time_s", pa.float64()),
])


def eval_row(m: dict[str, Any]) -> dict[str, Any]:
    """A report's validation figures as an eval.parquet row."""
    return {"epoch": m["epoch"], "step": m["step"], "samples": m["val_samples"], "loss": m["val_loss"],
            "accuracy": m.get("val_accuracy"), "perplexity": m.get("val_perplexity"),
            "time_s": m["val_time_s"]}


def unpack_windows(metrics: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """One report of every rank -> the windows it carries, oldest first, each a list of
    every rank's row. A rank sends its newest row at the top level and the older ones it
    had not sent yet under ``earlier``; all ranks send the same windows."""
    per_rank = [[*m.get("earlier", []), {k: v for k, v in m.items() if k != "earlier"}] for m in metrics]
    return [list(window) for window in zip(*per_rank)]


def rank_mean(rows: list[dict[str, Any]], key: str) -> Optional[float]:
    """The mean of ``key`` over ranks, each weighted by its units (a rank whose window
    held no rows has no loss to give, not a NaN to spread); tables written before the
    ``units`` column weight by samples."""
    weighted = [(r[key], r.get("units") if r.get("units") is not None else r["samples"])
                for r in rows if r.get(key) is not None]
    total = sum(w for _, w in weighted if w)
    if not total:
        return None
    return sum(v * w for v, w in weighted if w) / total
