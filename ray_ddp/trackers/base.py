"""The tracker protocol, and the set of trackers one run has. Runs on the driver (open,
resume, finish) and in Ray Train's controller (windows, events as they happen); workers
never talk to a tracker.

A tracker is made (started, or resumed: the same tracker run a resume continues) on the
driver before the first fit, travels pickled to each fit's controller, which logs every
metrics window and the events it sees, and is finished on the driver with the summary
and every event. A tracker that fails is dropped and named once at the end: the run
itself is in its folder, and no tracker is worth a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ray_ddp.record.events import Event


@dataclass(frozen=True)
class Window:
    """One metrics window of every rank: ``rows`` one per rank (record/schema.py's
    columns), ``figures`` the window over ranks as progress.json shows it (mean loss,
    summed throughput, the validation)."""

    step: int
    rows: list[dict[str, Any]]
    figures: dict[str, Any]


class Tracker:
    """One place the run's figures go. Each method does nothing unless a tracker needs
    it; a failure is an exception, which drops the tracker (Trackers)."""

    label = "tracker"  # how a warning names it, e.g. "MLflow at http://host:5000"

    def resume(self) -> "Tracker":
        """On the driver before each fit: the tracker as the new fit's controller needs it
        (an earlier fit's controller logged steps in a process that is gone)."""
        return self

    def log_window(self, window: Window) -> None:
        """In the controller: one window, at its step; a step logged before (a restart
        redoes steps) is not logged again."""

    def log_event(self, event: Event) -> None:
        """Where an event is first known (the controller's restarts, resizes and
        preemptions; the driver's hangs): as it happens."""

    def close(self) -> None:
        """In the controller, at the end of its fit: flush and let go of what it opened."""

    def finish(self, summary: dict[str, Any], events: list[Event], status: str,
               model_file: Optional[str], fit_over: bool = True) -> None:
        """On the driver at the end: the summary, every event of the run, the final model
        (local storage) and ``status`` (FINISHED, FAILED or KILLED). ``fit_over`` False:
        the run was stopped while its controller may still be logging a window."""


class Trackers:
    """The run's trackers, each called on its own: one that raises is dropped (its label
    kept in ``failed``) and the others go on."""

    def __init__(self, trackers: list[Tracker], failed: Optional[list[str]] = None):
        self.active = list(trackers)
        self.failed = list(failed or [])

    def resume(self) -> "Trackers":
        """Each tracker as a new fit's controller needs it, in place: the driver keeps one
        set, whose failures its warning at the end names."""
        self.active = self._each(lambda t: t.resume())
        return self

    def drop(self, labels: list[str]) -> None:
        """The trackers a controller dropped (progress.json's ``trackers_failed``): the
        next fit's controller does not try them again."""
        for tracker in [t for t in self.active if t.label in labels]:
            self.active.remove(tracker)
        self.failed += [label for label in labels if label not in self.failed]

    def log_window(self, window: Window) -> None:
        self._each(lambda t: t.log_window(window))

    def log_event(self, event: Event) -> None:
        self._each(lambda t: t.log_event(event))

    def close(self) -> None:
        self._each(lambda t: t.close())

    def finish(self, summary: dict[str, Any], events: list[Event], status: str,
               model_file: Optional[str], fit_over: bool = True) -> None:
        self._each(lambda t: t.finish(summary, events, status, model_file, fit_over))

    def _each(self, call) -> list[Any]:
        results = []
        for tracker in list(self.active):
            try:
                results.append(call(tracker))
            except Exception:  # the tracker's server, client or disk: never the run's end
                self.active.remove(tracker)
                self.failed.append(tracker.label)
                try:  # what it holds open (a W&B session, a writer's thread) is let go
                    tracker.close()
                except Exception:
                    pass
        return results
