"""Every rank's metrics, from ray.train.report to the run directory.

``MetricsCallback`` runs inside the Ray Train controller actor (not the driver): Ray
hands it the metrics of every rank after each report. It keeps the rows and writes
- ``progress.json`` after every report (the driver polls it to show progress), and
- ``metrics.parquet`` whenever a checkpoint lands, so the table always matches a
  checkpoint a resumed run would start from, and is complete at the end (the last
  epoch always checkpoints).
It also watches for stragglers (a rank whose step time stays above 1.5x the median for
several reports in a row) and, with ``--tensorboard``, writes the same metrics as
TensorBoard event files under ``<run>/tensorboard/``.
``summarize_metrics`` runs on the driver over the finished table.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import pyarrow as pa
from ray.train import UserCallback

from .storage import (EVAL_FILE, METRICS_FILE, PROGRESS_FILE, read_table, resolve_storage, write_json,
                      write_table)

# The columns every row has, in order; the issue names the first eight.
COLUMNS = ("epoch", "step", "rank", "loss", "samples", "step_time_s", "samples_per_s", "time", "busy_s",
           "world_size", "node_rank", "node_id", "lr", "weights_hash", "loaded_hash", "max_rss_mb",
           "gpu_max_mb", "started_at", "first_step_at", "accuracy", "perplexity", "preempted_node",
           "preemption_deadline", "units")
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
])
# eval.parquet: one row per validation (every rank reports the same all-reduced figures)
EVAL_SCHEMA = pa.schema([
    ("epoch", pa.int64()), ("step", pa.int64()), ("samples", pa.int64()), ("loss", pa.float64()),
    ("accuracy", pa.float64()), ("perplexity", pa.float64()), ("time_s", pa.float64()),
])


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


STRAGGLER_RATIO = 1.5
STRAGGLER_REPORTS = 3


class StragglerState:
    """Counts, per rank, the reports in a row whose own work time (``busy_s``: data and
    forward, outside the all-reduce where DDP makes every rank wait for the slowest) was
    > 1.5x the median rank's."""

    def __init__(self) -> None:
        self.streak: dict[int, int] = {}
        self.since: dict[int, int] = {}

    def update(self, metrics: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
        times = sorted(m["busy_s"] for m in metrics)
        median = (times[(len(times) - 1) // 2] + times[len(times) // 2]) / 2
        worst = None
        for m in metrics:
            rank = m["rank"]
            if len(metrics) > 1 and median > 0 and m["busy_s"] > STRAGGLER_RATIO * median:
                if not self.streak.get(rank):
                    self.since[rank] = m["step"]
                self.streak[rank] = self.streak.get(rank, 0) + 1
            else:
                self.streak[rank] = 0
            if self.streak[rank] >= STRAGGLER_REPORTS and (
                    worst is None or m["busy_s"] > worst["busy_s"]):
                worst = {"rank": rank, "ratio": m["busy_s"] / median,
                         "reports": self.streak[rank], "busy_s": m["busy_s"],
                         "median_s": median, "since_step": self.since[rank],
                         "node_id": m.get("node_id") or ""}
        return worst


class MetricsCallback(UserCallback):
    """Collects every rank's report into the run's metrics table and progress file."""

    def __init__(self, storage: str, name: str, epochs: int, total_steps: int,
                 tensorboard: bool = False, keep: int = 0, keep_best: bool = False):
        self.storage, self.name = storage, name
        self.total_steps = total_steps
        self.epochs = epochs
        self.tensorboard = tensorboard
        self.keep, self.keep_best = keep, keep_best  # with keep_best, Ray keeps all: we prune
        self._rows: Optional[list[dict[str, Any]]] = None  # loaded lazily in the controller
        self._evals: list[dict[str, Any]] = []
        self._stragglers = StragglerState()
        self._preemptions: list[dict[str, Any]] = []  # shown by the driver as they come
        self._tb = None

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        store = resolve_storage(self.storage)
        run_path = store.run_path(self.name)
        windows = unpack_windows(metrics)
        if self._rows is None:
            self._rows = _load_rows(store.fs, f"{run_path}/{METRICS_FILE}")
            self._evals = _load_rows(store.fs, f"{run_path}/{EVAL_FILE}")
        # Windows end on fixed steps, so a restarted worker group (or a resumed run)
        # re-reports the very steps it redoes: drop the earlier attempt's rows.
        first_step = int(windows[0][0]["step"])
        self._rows = [r for r in self._rows if r["step"] < first_step]
        self._evals = [r for r in self._evals if r["step"] < first_step]
        straggler = None
        for window in windows:
            self._rows += [{c: m.get(c) for c in COLUMNS} for m in window]
            if "val_loss" in window[0]:
                self._evals.append(eval_row(window[0]))
            straggler = self._stragglers.update(window)
        progress = summarize_report(
            windows[-1], self.epochs, self.total_steps,
            checkpoint=checkpoint.path.rsplit("/", 1)[-1] if checkpoint is not None else None,
        )
        progress["straggler"] = straggler
        if windows[-1][0].get("preempted_node") and checkpoint is not None:
            self._preemptions.append(describe_preemption(windows[-1][0], progress["checkpoint"]))
        progress["preemptions"] = self._preemptions
        # where each rank runs: the driver names the rank and node of a failure with it
        progress["nodes"] = {str(m["rank"]): m.get("node_id") for m in windows[-1]}
        write_json(store.fs, f"{run_path}/{PROGRESS_FILE}", progress)
        if self.tensorboard:
            for window in windows:
                self._write_tensorboard(store.path_on_disk(self.name), window)
            if progress["step"] >= self.total_steps:
                self._close_tensorboard()
        if checkpoint is not None:
            write_table(store.fs, f"{run_path}/{METRICS_FILE}",
                        pa.Table.from_pylist(self._rows, schema=SCHEMA))
            if self._evals:
                write_table(store.fs, f"{run_path}/{EVAL_FILE}",
                            pa.Table.from_pylist(self._evals, schema=EVAL_SCHEMA))
            if self.keep_best:
                prune_checkpoints(store.fs, run_path, self.keep, self._evals)

    def after_exception(self, run_context, worker_exceptions) -> None:
        self._close_tensorboard()

    def _close_tensorboard(self) -> None:
        """tensorboardX writes from a queue in a thread; flush() does not drain the queue,
        close() does: without it the last report's events are lost with the controller."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def _write_tensorboard(self, run_dir: str, metrics: list[dict[str, Any]]) -> None:
        if self._tb is None:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=f"{run_dir}/tensorboard")
        _write_tensorboard_rows(self._tb, metrics)


def describe_preemption(row: dict[str, Any], checkpoint: str) -> dict[str, Any]:
    """A preemption checkpoint, as progress.json and summary.json show it."""
    return {"node_id": row["preempted_node"], "step": int(row["step"]), "checkpoint": checkpoint,
            "deadline_in_s": round(row["preemption_deadline"] - row["time"], 1),
            "world_size": int(row["world_size"])}


def world_stretches(table: pa.Table) -> list[dict[str, int]]:
    """The world size of every stretch of the run, in step order: steps ``from_step``
    (exclusive) to ``to_step`` (inclusive) ran on ``world_size`` workers."""
    sizes = sorted({(r["step"], r["world_size"]) for r in table.select(["step", "world_size"]).to_pylist()})
    stretches: list[dict[str, int]] = []
    previous = 0
    for step, size in sizes:
        if stretches and stretches[-1]["world_size"] == size:
            stretches[-1]["to_step"] = step
        else:
            stretches.append({"world_size": size, "from_step": previous, "to_step": step})
        previous = step
    return stretches


def preemption_checkpoints(table: pa.Table) -> list[dict[str, Any]]:
    """Every checkpoint a preemption notice caused, from the metrics table (rank 0's rows)."""
    from .checkpoint import checkpoint_dir_name

    return [describe_preemption(r, checkpoint_dir_name(r["step"])) for r in table.to_pylist()
            if r["rank"] == 0 and r.get("preempted_node")]


def eval_row(m: dict[str, Any]) -> dict[str, Any]:
    """A report's validation figures as an eval.parquet row."""
    return {"epoch": m["epoch"], "step": m["step"], "samples": m["val_samples"], "loss": m["val_loss"],
            "accuracy": m.get("val_accuracy"), "perplexity": m.get("val_perplexity"),
            "time_s": m["val_time_s"]}


def best_checkpoint(names: list[str], evals: list[dict[str, Any]]) -> Optional[str]:
    """The checkpoint folder, among ``names``, whose validation loss was the lowest."""
    from .checkpoint import checkpoint_dir_name

    scored = [(r["loss"], checkpoint_dir_name(r["step"])) for r in evals
              if checkpoint_dir_name(r["step"]) in names and r["loss"] == r["loss"]]
    return min(scored)[1] if scored else None


def prune_checkpoints(fs, run_path: str, keep: int, evals: list[dict[str, Any]]) -> None:
    """--keep-best: keep the newest ``keep`` checkpoints and the best one, delete the rest."""
    from pyarrow.fs import FileSelector, FileType

    names = sorted(i.base_name for i in fs.get_file_info(FileSelector(run_path))
                   if i.type == FileType.Directory and i.base_name.startswith("step-"))
    kept = set(names[-keep:]) | {best_checkpoint(names, evals)}
    for name in names:
        if name not in kept:
            fs.delete_dir(f"{run_path}/{name}")


def unpack_windows(metrics: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """One report of every rank -> the windows it carries, oldest first, each a list of
    every rank's row. A rank sends its newest row at the top level and the older ones it
    had not sent yet under ``earlier``; all ranks send the same windows."""
    per_rank = [[*m.get("earlier", []), {k: v for k, v in m.items() if k != "earlier"}] for m in metrics]
    return [list(window) for window in zip(*per_rank)]


def _write_tensorboard_rows(writer, metrics: list[dict[str, Any]]) -> None:
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


def _load_rows(fs, path: str) -> list[dict[str, Any]]:
    table = read_table(fs, path)
    return [] if table is None else table.to_pylist()


def summarize_report(metrics: list[dict[str, Any]], epochs: int, total_steps: int,
                     checkpoint: Optional[str]) -> dict[str, Any]:
    """One report of all ranks, as the driver shows it: mean loss, summed throughput."""
    first = metrics[0]
    return {
        "epoch": int(first["epoch"]),
        "epochs": epochs,
        "step": int(first["step"]),
        "total_steps": total_steps,
        "loss": rank_mean(metrics, "loss"),
        **{k: rank_mean(metrics, k) for k in ("accuracy", "perplexity") if first.get(k) is not None},
        **{k: first[k] for k in ("val_loss", "val_accuracy", "val_perplexity") if k in first},
        "samples_per_s": sum(m["samples_per_s"] for m in metrics),
        "world_size": len(metrics),
        "checkpoint": checkpoint,
        "time": time.time(),
    }


def summarize_metrics(table: pa.Table, after_step: int = 0) -> dict[str, Any]:
    """Final loss (mean over ranks at the last step) and two throughputs:
    - ``samples_per_s``, the steady state: all ranks' samples of a report / the slowest
      rank's window time, the first report (warm-up: process start, first allocations)
      left out when there are others;
    - ``wall_samples_per_s``: every sample this run trained (the steps after
      ``after_step``, where it resumed) over the wall time from the start of its first
      step to the end of its last, checkpoints and reports included.
    """
    rows = table.to_pylist()
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(r)
    steps = sorted(by_step)
    last = by_step[steps[-1]]
    measured = steps[1:] if len(steps) > 1 else steps
    samples = sum(sum(r["samples"] for r in by_step[s]) for s in measured)
    seconds = sum(max(r["step_time_s"] for r in by_step[s]) for s in measured)
    this_run = [r for r in rows if r["step"] > after_step]
    wall = (max(r["time"] for r in this_run) - min(r["time"] - r["step_time_s"] for r in this_run)
            if this_run else 0.0)
    return {
        "final_loss": rank_mean(last, "loss"),
        "samples_per_s": samples / seconds if seconds > 0 else 0.0,
        "wall_samples_per_s": sum(r["samples"] for r in this_run) / wall if wall > 0 else None,
        "reports": len(steps),
    }
