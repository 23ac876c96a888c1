"""The worker-group restarts and resizes one fit saw, as events, each passed to the
run's trackers as it is made: a restart RestartRecorder (observe/restarts.py) recorded as
it happened, or one found when a new group's first report comes without it; a restart's
source settled by the new group's rank 0 (a node's in-memory snapshot); a resize when a
new group runs at another world size. Runs in Ray Train's controller."""

from __future__ import annotations

from typing import Any, Callable, Optional

from ray_ddp.record.events import Event, resize_event, restart_event, settle_restart
from ray_ddp.record.failures import FailureSummary
from ray_ddp.trackers.base import Trackers


def opens_group(window: list[dict[str, Any]]) -> bool:
    """Whether a window is a new worker group's first (its ranks' rows carry started_at)."""
    return any(m.get("started_at") is not None for m in window)


class GroupEvents:
    def __init__(self, trackers: Trackers) -> None:
        self.trackers = trackers
        self.events: list[Event] = []
        self.recorded = False  # RestartRecorder recorded the running group's restart

    def add(self, event: Event, recorded: bool = True) -> None:
        self.events.append(event)
        self.trackers.log_event(event)
        self.recorded = self.recorded or recorded

    def note_restart(self, first_window: list[dict[str, Any]], last_step: Optional[int],
                     last_checkpoint: tuple[Optional[str], int], preempted_at: Callable[[int], bool]) -> None:
        """Record an event when this report opens a new worker group within this fit and
        RestartRecorder did not record its restart as it happened (its hooks are Ray's
        DeveloperAPI: a fallback that holds if they stop being called); then settle it by
        rank 0's first row."""
        if not opens_group(first_window):
            return
        if last_step is not None and not self.recorded:
            name, at = last_checkpoint
            self.add(restart_event(FailureSummary(-1, "?", None, ""), last_step, name, preempted_at(at)),
                     recorded=False)
        self.recorded = False
        self.settle(min(first_window, key=lambda m: m.get("rank", 0)))  # rank 0's: where it started

    def settle(self, started: dict[str, Any]) -> None:
        """Where a new group's rank 0 says it loaded a node's in-memory snapshot (newer than
        the checkpoint the restart was recorded with), the restart's event takes it and
        the steps it redoes."""
        if started.get("resumed_from_node") is not None and self.events and self.events[-1].restarted:
            self.events[-1] = settle_restart(self.events[-1], int(started["resumed_at"]),
                                             started.get("resumed_from"), started.get("resumed_from_node"))

    def note_resize(self, first_window: list[dict[str, Any]], before: Optional[tuple[int, int]]) -> None:
        """Record a resize when a new worker group runs at another world size than the
        window before it (Ray Train's elastic restart, or the driver's restart of an
        elastic run): said by the driver as it happens, found again in the table at the end."""
        if before is None or not opens_group(first_window):
            return
        last, world = before
        if world != len(first_window):
            self.add(resize_event(last, world, len(first_window)), recorded=False)
