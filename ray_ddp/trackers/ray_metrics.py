"""The run's figures in Ray's own metrics (``ray.util.metrics``): each node's Prometheus
endpoint serves them beside Ray's, and Ray's dashboard and Grafana chart them
(trackers/grafana_dashboard.json). Runs in Ray Train's controller (every window, and the
restarts and preemptions it sees) and on the driver (the hangs its watch finds).

Prometheus names are Ray's ``ray_`` prefix and the names below: ``ray_ddp_step_time_seconds``
and so on. Gauges carry the tags run, rank and node where the figure is a rank's, run
alone where it is the run's; counters count events over the run's processes (sum them by run).
"""

from __future__ import annotations

import functools
from typing import Any

from ray_ddp.record.events import Event
from ray_ddp.trackers.base import Tracker, Window

# name: (what it is, the row's column); tagged run, rank and node
RANK_GAUGES = {
    "ddp_step_time_seconds": ("a rank's mean step time over the last window, seconds", "step_time_s"),
    "ddp_busy_seconds": ("a rank's own work per step, waits for its peers left out: the straggler is the "
                         "rank whose busy time is longest", "busy_s"),
    "ddp_samples_per_second": ("a rank's samples per second over the last window", "samples_per_s"),
    "ddp_tokens_per_second": ("a rank's input tokens per second over the last window (token tasks)",
                              "tokens_per_s"),
    "ddp_data_wait_share": ("the share of a rank's window spent waiting for its batches", "data_wait_share"),
    "ddp_mfu": ("a rank's model FLOPs utilisation over the last window (GPU, token tasks)", "mfu"),
    "ddp_loss": ("a rank's mean training loss over the last window", "loss"),
    "ddp_grad_norm": ("the gradient norm before clipping, the window's mean", "grad_norm"),
}
# tagged run
RUN_GAUGES = {
    "ddp_step": "the last global step the run reported",
    "ddp_world_size": "the number of ranks training now",
    "ddp_checkpoint_save_seconds": "the training thread's stall for the last checkpoint, seconds",
    "ddp_checkpoint_upload_seconds": "the last checkpoint's write into run storage, seconds",
}
COUNTERS = {
    "ddp_restarts": "worker groups restarted after a failure (restarts within a fit)",
    "ddp_hangs": "hangs the hang watch found",
    "ddp_preemptions": "preemption notices the run checkpointed for",
}
RANK_TAGS, RUN_TAGS = ("run", "rank", "node"), ("run",)


@functools.lru_cache(maxsize=None)
def _metric(name: str):
    """Each metric once per process (Ray's registry refuses a second of the same name)."""
    from ray.util.metrics import Counter, Gauge

    if name in RANK_GAUGES:
        return Gauge(name, RANK_GAUGES[name][0], tag_keys=RANK_TAGS)
    if name in RUN_GAUGES:
        return Gauge(name, RUN_GAUGES[name], tag_keys=RUN_TAGS)
    return Counter(name, COUNTERS[name], tag_keys=RUN_TAGS)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


class RayMetricsTracker(Tracker):
    """Sets the gauges from each window and counts the events it is told of."""

    def __init__(self, run: str):
        self.run = run
        self.label = "Ray's metrics"
        self._ranks: set[tuple[str, str]] = set()  # (rank, node) of the series set so far

    def log_window(self, window: Window) -> None:
        ranks = set()
        for row in window.rows:
            tags = {"run": self.run, "rank": str(row["rank"]), "node": str(row.get("node_id") or "")}
            ranks.add((tags["rank"], tags["node"]))
            for name, (_, column) in RANK_GAUGES.items():
                if _number(row.get(column)):
                    _metric(name).set(float(row[column]), tags=tags)
        # a rank gone (a smaller group, a rank on another node) does no work: a sum of
        # throughputs must not count its last figure (Ray keeps a gauge's series)
        for rank, node in self._ranks - ranks:
            for name in ("ddp_samples_per_second", "ddp_tokens_per_second"):
                _metric(name).set(0.0, tags={"run": self.run, "rank": rank, "node": node})
        self._ranks = ranks
        tags = {"run": self.run}
        _metric("ddp_step").set(window.step, tags=tags)
        _metric("ddp_world_size").set(len(window.rows), tags=tags)
        first = window.rows[0]
        for name, column in (("ddp_checkpoint_save_seconds", "checkpoint_save_s"),
                             ("ddp_checkpoint_upload_seconds", "checkpoint_upload_s")):
            if _number(first.get(column)):
                _metric(name).set(float(first[column]), tags=tags)

    def log_event(self, event: Event) -> None:
        tags = {"run": self.run}
        if event.type == "hang":
            _metric("ddp_hangs").inc(1, tags=tags)
        if event.type == "preemption":
            _metric("ddp_preemptions").inc(1, tags=tags)
        if event.restarted:
            _metric("ddp_restarts").inc(1, tags=tags)
