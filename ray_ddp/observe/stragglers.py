"""Stragglers: a rank whose own work time stays above 1.5x the median for several
reports in a row. Runs in Ray Train's controller.
"""

from __future__ import annotations

from typing import Any, Optional


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
