"""A run's events: every lost worker, preemption and change of world size, each said in
one line when it happens and kept in ``events`` of status.json and summary.json. Runs on
the driver.

An event is a dict of ``type`` (``failure``, ``hang``, ``preemption``, ``resize``),
``time`` (seconds since the epoch), ``step`` (the last step the run reported), ``rank``
and ``node`` (where it happened; None for a resize), ``cause`` (one line),
``from_checkpoint`` (the checkpoint the run restarted from; None when it stopped or
went on) and ``steps_lost`` (steps to redo).
"""

from __future__ import annotations

import time
from typing import Any, Optional

from ray_ddp.driver.failures import FailureSummary

KINDS = ("failure", "hang", "preemption", "resize")


def failure_event(failure: FailureSummary, step: Optional[int], restarted_from: Optional[str],
                  resumed_step: int, preemption: bool) -> dict[str, Any]:
    """A failed worker group, as the driver saw it: restarted from ``restarted_from``
    (whose step is ``resumed_step``), or the run's end (``restarted_from`` None)."""
    lost = max(0, step - resumed_step) if step is not None and restarted_from is not None else 0
    return {"type": "preemption" if preemption else "failure", "time": time.time(), "step": step,
            "rank": failure.rank, "node": failure.node, "cause": failure.cause,
            "from_checkpoint": restarted_from, "steps_lost": lost}


def table_events(rows: list[dict[str, Any]], stretches: list[dict[str, int]]) -> list[dict[str, Any]]:
    """What the metrics table shows: preemption checkpoints Ray Train restarted from at
    the deadline, and every change of world size."""
    events = []
    for r in rows:
        if r["rank"] == 0 and r.get("preempted_node"):
            from ray_ddp.checkpoint.format import checkpoint_dir_name

            events.append({"type": "preemption", "time": r["time"], "step": int(r["step"]), "rank": None,
                           "node": r["preempted_node"], "cause": "the node's preemption notice",
                           "from_checkpoint": checkpoint_dir_name(int(r["step"])), "steps_lost": 0})
    for before, after in zip(stretches, stretches[1:]):
        at = [r["time"] for r in rows if r["step"] == before["to_step"]]
        events.append({"type": "resize", "time": max(at) if at else None, "step": before["to_step"],
                       "rank": None, "node": None,
                       "cause": f"world size {before['world_size']} -> {after['world_size']}",
                       "from_checkpoint": None, "steps_lost": 0})
    return events


def attribute_hangs(restarts: list[dict[str, Any]], hangs: list[dict[str, Any]]
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The restarts Ray Train made, each that followed a hang the watch declared told as
    that hang (its rank, node and cause; where it restarted from and the steps lost are
    the restart's), and the hangs no restart followed (the run stopped there)."""
    out, pending = list(restarts), []
    for hang in sorted(hangs, key=lambda e: e["time"]):
        k = next((i for i, e in enumerate(out) if e["type"] == "failure" and (e["time"] or 0) > hang["time"]),
                 None)
        if k is None:
            pending.append(hang)
        else:
            out[k] = restarted_after_hang(hang, out[k]["from_checkpoint"], out[k]["steps_lost"])
    return out, pending


def restarted_after_hang(hang: dict[str, Any], checkpoint: Optional[str], steps_lost: int) -> dict[str, Any]:
    """The hang, restarted from ``checkpoint``: the steps lost count from the hang's step
    (the watch knows it from the heartbeats; a restart only from the reports)."""
    import re

    found = re.search(r"step-(\d+)", checkpoint or "")
    since = int(found[1]) if found else 0
    lost = max(steps_lost, hang["step"] - since) if checkpoint is not None else 0
    return {**hang, "from_checkpoint": checkpoint, "steps_lost": lost}


def merge_events(*lists: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every event once, in time order; where two lists hold the same one (a preemption
    the driver restarted from is in the table too), the earlier list's record wins."""
    seen, out = set(), []
    for event in (e for events in lists for e in events):  # the first list's record wins
        kind = event["type"]
        key = (kind, event.get("from_checkpoint")) if kind == "preemption" else \
            (kind, event["step"]) if kind == "resize" else (kind, event["time"])
        if key not in seen:
            seen.add(key)
            out.append(event)
    return sorted(out, key=lambda e: e["time"] or 0.0)


def count_restarts(events: list[dict[str, Any]]) -> int:
    """Restarts of the worker group: the failures and preemptions it went on from."""
    return sum(1 for e in events if e["type"] in ("failure", "hang", "preemption") and e.get("from_checkpoint"))
