"""MetricsCallback: every rank's metrics, from ray.train.report to the run folder and the
run's trackers. Runs inside Ray Train's controller actor (not the driver). Its parts,
each owning its state: the tables (observe/run_table.py), the restarts and resizes
(observe/group_events.py), the stragglers (observe/stragglers.py), the trackers
(trackers/); it keeps progress.json and prunes checkpoints under --keep-best.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

from ray.train import UserCallback

from ray_ddp.checkpoint.retention import prune_checkpoints
from ray_ddp.errors import StorageError
from ray_ddp.observe.group_events import GroupEvents
from ray_ddp.observe.run_table import RunTable
from ray_ddp.record.schema import unpack_windows
from ray_ddp.observe.stragglers import StragglerState
from ray_ddp.observe.summarize import describe_preemption, summarize_report
from ray_ddp.record.events import Event, to_records
from ray_ddp.record.folder import Progress, RunFolder
from ray_ddp.storage import write_json
from ray_ddp.trackers.base import Trackers, Window


class MetricsCallback(UserCallback):
    """Collects every rank's report into the run folder: the metrics table (each report's
    rows in storage before the next report), the validation table, progress.json, and the restarts and resizes
    it sees; passes the windows and events on to the run's trackers (trackers/)."""

    def __init__(self, folder: RunFolder, epochs: int, total_steps: int,
                 keep: int = 0, keep_best: bool = False, trackers: Optional[Trackers] = None):
        self.folder = folder  # made on the driver, its filesystem with it: never reopened here
        self.total_steps = total_steps
        self.epochs = epochs
        self.keep, self.keep_best = keep, keep_best  # with keep_best, Ray keeps all: we prune
        self._table = RunTable()
        self._stragglers = StragglerState()
        self._preemptions: list[dict[str, Any]] = []  # shown by the driver as they come
        self._nodes: dict[str, Any] = {}  # rank -> node ID of the group now running
        self._progress: Optional[Progress] = None  # progress.json as last written
        self._last_step: Optional[int] = None  # the last step reported in this fit
        self._group_step: Optional[int] = None  # the last step the running worker group reported
        self._last_checkpoint: Optional[tuple[str, int]] = None  # (its folder, its step)
        self.trackers = trackers if trackers is not None else Trackers([])
        self._groups = GroupEvents(self.trackers)  # worker-group restarts and resizes within this fit

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        if "group_started" in metrics[0]:  # a group resumed from a node's snapshot says so at once
            started = metrics[0]["group_started"]
            self._groups.settle(started)
            if started.get("carried"):
                self._keep_carried(started["carried"])
            self._write_progress(self._progress_now(events=to_records(self._groups.events)))
            return
        folder = self.folder
        windows = unpack_windows(metrics)
        self._table.load(folder)
        # Windows end on fixed steps, so a restarted worker group (or a resumed run)
        # re-reports the very steps it redoes: its rows replace the earlier attempt's.
        # a new group's first row says where it resumed: the steps after it are redone,
        # even where its first window ends later than the earlier attempt's did; the rows
        # a snapshot or checkpoint carried (no report had sent them, an earlier group's
        # first among them perhaps) come before it: the last window that opens a group
        opening = next((w for w in reversed(windows) if w[0].get("started_at") is not None), windows[0])
        resumed = opening[0].get("resumed_at")
        first_step = int(windows[0][0]["step"]) if resumed is None else min(int(windows[0][0]["step"]),
                                                                              int(resumed) + 1)
        self._groups.note_restart(opening, self._last_step, self._last_checkpoint or (None, 0), self.preempted_at)
        self._groups.note_resize(opening, self._table.world_before(first_step))
        self._table.record(first_step, windows)
        straggler = None
        for window in windows:
            straggler = self._stragglers.update(window)
            self._log_window(window)
        progress = self._progress_after(windows, checkpoint, straggler)
        self._write_progress(progress)
        if progress.step >= self.total_steps or progress.early_stop:
            self.trackers.close()
        self._store_rows(progress.step, seal=checkpoint is not None)
        if any("val_loss" in window[0] for window in windows) or (checkpoint is not None and self._table.evals):
            self._table.write_evals(folder)
        if checkpoint is not None and self.keep_best:
            prune_checkpoints(folder, self.keep, self._table.evals)

    def _keep_carried(self, windows: list[list[dict[str, Any]]]) -> None:
        """The windows a node's snapshot of another world size held (an elastic restart's;
        rank 0 of the new group sends them whole, before its first step): in the table,
        in storage at once, and to the trackers, as if their own group had reported them.
        The new group's first report then finds the resize after them."""
        first_step = int(windows[0][0]["step"])
        self._table.load(self.folder)
        self._table.world_before(first_step)  # what the failed group reported before them stays
        self._table.record(first_step, windows)
        for window in windows:
            self._log_window(window)
        self._store_rows(int(windows[-1][0]["step"]), seal=False)
        if any("val_loss" in window[0] for window in windows):
            self._table.write_evals(self.folder)

    def _log_window(self, window: list[dict[str, Any]]) -> None:
        """One window of every rank's rows to the run's trackers."""
        self.trackers.log_window(Window(int(window[0]["step"]), window, summarize_report(
            window, self.epochs, self.total_steps, checkpoint=None)))

    def _store_rows(self, step: int, seal: bool) -> None:
        """Every report's rows reach storage before the next report: a failure, an
        interruption or a killed driver loses none of the rows that explain it."""
        try:
            self._table.write_rows(self.folder, seal=seal)
        except StorageError:
            if seal:  # a checkpoint's rows must be in storage with it
                raise
            # the rows stay in the open part, in memory, and go out with the next report
            print(f"warning: ray_ddp could not write the metrics rows of step {step} to storage; "
                  "trying again at the next report", flush=True)

    def _progress_after(self, windows: list[list[dict[str, Any]]], checkpoint, straggler) -> Progress:
        """progress.json after a report: its last window over every rank, and what this fit saw."""
        report = summarize_report(
            windows[-1], self.epochs, self.total_steps,
            checkpoint=checkpoint.path.rsplit("/", 1)[-1] if checkpoint is not None else None,
        )
        if checkpoint is not None:
            self._last_checkpoint = (report["checkpoint"], int(windows[-1][0]["step"]))
        if windows[-1][0].get("preempted_node") and checkpoint is not None:
            self._preemptions.append(describe_preemption(windows[-1][0], report["checkpoint"]))
        self._last_step = self._group_step = int(windows[-1][0]["step"])
        # where each rank runs: the driver names the rank and node of a failure with it
        self._nodes = {str(m["rank"]): m.get("node_id") for m in windows[-1]}
        return Progress(
            **report, straggler=straggler, preemptions=self._preemptions,
            events=to_records(self._groups.events),  # restarts Ray Train made itself (--max-failures)
            **self._trackers_failed(), nodes=self._nodes,
            report_time=report["time"])  # "time" also moves with a later event

    # What observe/restarts.py's RestartRecorder (the same controller) reads and records.

    def group_step(self) -> Optional[int]:
        """The last step the running worker group reported (None before its first report)."""
        return self._group_step

    def last_checkpoint_name(self) -> Optional[str]:
        return self._last_checkpoint[0] if self._last_checkpoint else None

    def preempted_at(self, step: int) -> bool:
        """Whether the checkpoint at ``step`` was saved for a node's preemption notice."""
        return bool(self._preemptions) and self._preemptions[-1]["step"] == step

    def note_group(self, nodes: dict[str, Any]) -> None:
        """A worker group started: where its ranks run, in progress.json at once, so a
        failure before its first report still names the node."""
        self._nodes, self._group_step = nodes, None
        self._write_progress(self._progress_now(nodes=nodes))

    def note_last_step(self, step: int) -> None:
        """A worker group failed past its last report (its heartbeats went on): that step
        in progress.json, where the driver's line of a run that ends there reads it."""
        if self._progress is None or (self._progress.step or 0) < step:
            self._write_progress(self._progress_now(step=step))

    def add_event(self, event: Event) -> None:
        """A restart, in progress.json at once: the driver says it as it happens."""
        self._groups.add(event)
        self._write_progress(self._progress_now(events=to_records(self._groups.events), nodes=self._nodes))

    def _progress_now(self, **changes) -> Progress:
        """The last progress.json with ``changes``, written now (none yet: only them)."""
        return dataclasses.replace(self._progress or Progress(time.time()), time=time.time(),
                                   **{**self._trackers_failed(), **changes})

    def _trackers_failed(self) -> dict[str, Any]:
        failed = self.trackers.failed
        return {"trackers_failed": list(failed), "mlflow_failed": any(f.startswith("MLflow") for f in failed)}

    def _write_progress(self, progress: Progress) -> None:
        """progress.json whole; its ``time`` changes at each write (the driver polls it)."""
        self._progress = progress
        write_json(self.folder.fs, self.folder.progress, progress.to_dict())

    def after_exception(self, run_context, worker_exceptions) -> None:
        self.trackers.close()
