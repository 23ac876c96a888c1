"""A report and a finished metrics table, as the driver shows them: the loss, the
throughputs, the world-size stretches, the preemptions, an early stop. Runs in the
controller and on the driver.
"""

from __future__ import annotations

import time
from typing import Any, Optional
import pyarrow as pa
from ray_ddp.record.names import checkpoint_dir_name
from ray_ddp.record.schema import rank_mean


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
    return [describe_preemption(r, checkpoint_dir_name(r["step"])) for r in table.to_pylist()
            if r["rank"] == 0 and r.get("preempted_node")]


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
        **({"early_stop": describe_early_stop(first, epochs)} if first.get("early_stopped") else {}),
    }


def describe_early_stop(row: dict[str, Any], epochs: int) -> dict[str, Any]:
    """The report that --early-stop ended the run with, as progress.json shows it (the
    driver's line): the last val_loss, the validations in a row that did not lower it,
    the best and the epoch it came at, the epoch the run stopped after."""
    return {"val_loss": row["val_loss"], "stale": row.get("early_stop_stale"),
            "best": row.get("early_stop_best"), "best_epoch": row.get("early_stop_best_epoch"),
            "epoch": int(row["epoch"]), "epochs": epochs}


def early_stop_row(table: Optional[pa.Table], step: int) -> Optional[dict[str, Any]]:
    """Rank 0's metrics row at global step ``step`` if --early-stop ended the run there
    (``early_stopped``), else None; a table written before that column has none."""
    if table is None or "early_stopped" not in table.column_names:
        return None
    for row in table.select(["epoch", "step", "rank", "early_stopped"]).to_pylist():
        if row["step"] == step and row["rank"] == 0 and row["early_stopped"]:
            return row
    return None


def summarize_metrics(table: pa.Table, after_step: int = 0, trained_until: Optional[float] = None,
                      command_started: Optional[float] = None) -> dict[str, Any]:
    """Final loss (the units-weighted mean over ranks at the last step) and three
    throughputs, each what its name says:
    - ``samples_per_s``: the steady rate of training steps (forward, backward, gradient
      sync, optimizer): all ranks' samples of a window / the slowest rank's time in its
      steps (a window's time leaves out the reports, checkpoints and validation that
      follow its steps), the first window (warm-up) left out when there are others;
    - ``train_samples_per_s``: every sample this run trained (the steps after
      ``after_step``, where it resumed; a step redone after a restart counts once) over
      the time from the start of its first step to ``trained_until`` (fit() returned:
      every report and checkpoint included);
    - ``wall_samples_per_s``: the same samples over the command's whole wall time, from
      ``command_started`` (the process's start) to now: start-up included.
    And the figures the field reads, over the same windows as ``samples_per_s``:
    ``tokens_per_s`` (all ranks' input tokens / the slowest rank's time; token tasks),
    ``data_wait_s`` (seconds a step waited for its micro-batches, the slowest rank's, per
    step) and ``data_wait_share`` (of the steps' time), ``mfu`` (the ranks' mean; GPU
    token tasks), and ``grad_norm`` (the last window's, before clipping: the same on
    every rank, whose gradients are all-reduced).
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
    this_run = [r for r in rows if r["step"] > after_step]  # one attempt per step: the table keeps the last
    trained = sum(r["samples"] for r in this_run)
    first_step = min((r["time"] - r["step_time_s"] for r in this_run), default=None)
    end = trained_until if trained_until is not None else max((r["time"] for r in this_run), default=None)
    train_span = end - first_step if first_step is not None and end is not None else 0.0
    wall = time.time() - command_started if command_started is not None else 0.0
    tokens = sum(sum(r.get("tokens") or 0 for r in by_step[s]) for s in measured)
    step_count = sum(s - p for p, s in zip([0] + steps, steps) if s in measured)  # steps in those windows
    waits = [max(r.get("data_wait_s") or 0.0 for r in by_step[s]) for s in measured]
    mfus = [r["mfu"] for s in measured for r in by_step[s] if r.get("mfu") is not None]
    norms = [r["grad_norm"] for r in last if r.get("grad_norm") is not None]
    return {
        "tokens_per_s": tokens / seconds if tokens and seconds > 0 else None,
        "data_wait_s": sum(waits) / step_count if step_count > 0 and any(r.get("data_wait_s") is not None
                                                                         for r in last) else None,
        "data_wait_share": sum(waits) / seconds if seconds > 0 and any(r.get("data_wait_s") is not None
                                                                        for r in last) else None,
        "grad_norm": norms[0] if norms else None,
        "mfu": sum(mfus) / len(mfus) if mfus else None,
        "final_loss": rank_mean(last, "loss"),
        "samples_per_s": samples / seconds if seconds > 0 else 0.0,
        "train_samples_per_s": trained / train_span if train_span > 0 else None,
        "wall_samples_per_s": trained / wall if wall > 0 and trained else None,
        "reports": len(steps),
    }
