"""The supervisor of a run's fits: it runs them until one ends the run, keeps status.json
telling where the run stands, turns each failed fit into an event and asks
``decide_restart`` whether the run goes on, from the newest checkpoint. Runs on the
driver.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from ray_ddp.checkpoint.verify import CheckpointScan, find_latest_checkpoint
from ray_ddp.cluster.placement import Placement
from ray_ddp.cluster.runtime_env import nccl_hang_env, train_controller_env
from ray_ddp.driver.fit import controller_events, drop_failed_trackers, fit_on_ray, fold_metrics_after_fit, \
    plan_workers
from ray_ddp.driver.hangs import HangMonitor
from ray_ddp.driver.restart_decision import RestartDecision, RestartPolicyConfig, RestartState, decide_restart
from ray_ddp.driver.start import StartState
from ray_ddp.errors import TrainingError
from ray_ddp.record.metrics_table import read_metrics
from ray_ddp.observe.summarize import world_stretches
from ray_ddp.plan import RunPlan
from ray_ddp.record.events import (Event, attribute_hangs, failure_event, merge_events, restarted_after_hang,
                                   steps_to_redo, table_events)
from ray_ddp.record.folder import Progress
from ray_ddp.record.progress import read_progress, show_progress
from ray_ddp.checkpoint.retention import drop_unfinished
from ray_ddp.record.status import read_events, write_status
from ray_ddp.storage import Storage


def fit_with_status(run: RunPlan, store: Storage, placement: Placement,
                    start: StartState, objects: dict[str, Any], echo: Callable[[str], None], *,
                    init_from: Optional[str] = None, model_loss: bool = False, tracking=None,
                    ray_inputs=None, fit: Optional[Callable[..., None]] = None) -> None:
    """The run's fits under a FitSupervisor. ``init_from``: a new run's first weights;
    ``model_loss``: batches hand the model its labels (WorkerPlan); ``tracking``: the
    run's Trackers; ``ray_inputs``: the trainer's Ray Datasets, their DataConfig and the
    workers' RayDataTables (data/ray_data.py); ``fit``: what runs the workers,
    ``fit_on_ray`` (a TorchTrainer) unless the caller brings its own (the tests' gloo
    harness: plain processes, for ray_ddp's own code)."""
    FitSupervisor(run, store, placement, start, objects, echo, init_from=init_from, model_loss=model_loss,
                  tracking=tracking, ray_inputs=ray_inputs, fit=fit or fit_on_ray).supervise()


class FitSupervisor:
    """One command's fits of a run, and what it records of them: this command's events
    (``events``), the hangs that ended a fit with no restart within it (``pending``), the
    restarts so far (``restarts``) and the newest checkpoint (``scan``)."""

    def __init__(self, run: RunPlan, store: Storage, placement: Placement, start: StartState,
                 objects: dict[str, Any], echo: Callable[[str], None], *, init_from: Optional[str],
                 model_loss: bool, tracking, ray_inputs, fit: Callable[..., None]):
        self.run, self.store, self.placement, self.start = run, store, placement, start
        self.objects, self.echo, self.fit = objects, echo, fit
        self.init_from, self.model_loss, self.tracking, self.ray_inputs = init_from, model_loss, tracking, ray_inputs
        self.cfg = run.config  # the user's options (the plan's own values: self.run)
        self.folder = run.folder  # the run's folder with its filesystem (record/folder.py)
        self.scan: CheckpointScan = start.scan
        self.restarts = RestartState()
        self.policy = RestartPolicyConfig(placement.elastic, self.cfg.max_failures, self.cfg.max_preemptions)
        self.earlier = read_events(self.folder)  # of the commands before this one
        self.events: list[Event] = []
        self.pending: list[Event] = []

    def supervise(self) -> None:
        """Fit until the run is complete (status "complete"), or ends: "failed" with the
        one line, "interrupted"; a bug or a storage failure never leaves "running"."""
        self._status("running", run_id=self.start.run_id)
        self.monitor = HangMonitor(self.cfg.hang_timeout, self.folder, self.echo, self.cfg.wait_timeout)
        try:
            while not self._fit_once():
                pass
        except TrainingError as err:
            self._status("failed", error=str(err), events=self._all_events())
            raise
        except KeyboardInterrupt:
            self._status("interrupted")
            raise
        except BaseException as err:
            self._status("failed", error=f"{type(err).__name__}: {err}")
            raise
        finally:
            self.monitor.close()
        self._complete()

    def _fit_once(self) -> bool:
        """One fit: True when it finished the run; False when it failed and the run starts
        again (a failure that ends the run is raised, as one line)."""
        try:
            self._fit()
            return True
        except TrainingError as err:
            self._restart_or_raise(err)
            return False

    def _fit(self) -> None:
        try:
            with show_progress(self.folder, self.echo, enabled=not self.cfg.quiet,
                               hangs=lambda: list(self.monitor.hangs)), \
                    train_controller_env(nccl_hang_env(self.placement.backend, self.cfg.hang_timeout)):
                plan = plan_workers(self.run, self.scan, self.objects, self.init_from, self.model_loss,
                                    self.monitor.actor, self.ray_inputs[2] if self.ray_inputs else None)
                if self.tracking is not None:  # the steps an earlier fit's controller logged: not logged twice
                    self.tracking.resume()
                self.fit(self.cfg, self.store, self.placement, plan, self.objects, self.tracking, self.ray_inputs)
        finally:  # the restarts Ray Train made within this fit, before the next overwrites them
            self._take_fit_events()

    def _take_fit_events(self) -> None:
        told, self.pending = attribute_hangs(controller_events(self.folder), self.monitor.take_hangs())
        self.events.extend(told)
        if self.tracking is not None:
            drop_failed_trackers(self.tracking, self.folder)
            for hang in (e for e in told if e.type == "hang"):
                # the controller counted the restart of its event; the hang is the driver's
                self.tracking.log_event(dataclasses.replace(hang, restarted=False))
        fold_metrics_after_fit(self.folder)

    def _restart_or_raise(self, err: TrainingError) -> None:
        """The failed fit as an event; the run started again if decide_restart says so,
        else the failure raised with the reason."""
        if self.pending and err.failure is not None:  # the watch ended the group: say why
            err = TrainingError(self.pending[-1].cause.removeprefix("hang: "), err.failure, err.step)
        self.scan = drop_unfinished(self.folder, find_latest_checkpoint(self.folder, verify_crc=True))
        decision = self._decide(err)
        if decision is None:  # Ray's controller failed: no rank to name, nothing to decide
            raise err
        self.restarts = decision.state
        event = failure_event(err.failure, err.step, decision.restart, self.scan.latest,
                              preemption=decision.preemption)
        if self.pending:
            event = restarted_after_hang(self.pending[-1], event)
        self.events.append(event)
        if self.tracking is not None:
            self.tracking.log_event(event)
        if not decision.restart:
            raise TrainingError(str(err) + decision.reason, err.failure, err.step)
        self.echo(f"{err}; restarting from {self.scan.latest or 'scratch'} ({decision.reason})"
                  + self._steps_to_redo(err.step))
        self._status("running", events=self._all_events())

    def _decide(self, err: TrainingError) -> Optional[RestartDecision]:
        """decide_restart for a fit that ended in ``err``, with the nodes progress.json
        knows (those preempted, those the ranks ran on); None when no rank explains it."""
        if err.failure is None:
            return None
        progress = read_progress(self.folder) or Progress(0.0)
        preempted = {n for p in progress.preemptions for n in str(p.get("node_id", "")).split(",") if n}
        run_nodes = {str(n) for n in progress.nodes.values() if n}
        return decide_restart(err.failure, self.policy, self.restarts, preempted, run_nodes, self.scan.latest)

    def _steps_to_redo(self, step: Optional[int]) -> str:
        if step is None:
            return ""
        return steps_to_redo(step - (self.scan.meta["step"] if self.scan.meta else 0))

    def _complete(self) -> None:
        """status "complete", with the table's story: its preemptions and resizes, earlier
        commands' too."""
        table = read_metrics(self.folder)
        stretches = world_stretches(table) if table is not None and table.num_rows else None
        events = merge_events(self.earlier + self.events, table_events(table.to_pylist(), stretches or [])) \
            if table is not None else self._all_events()
        self._status("complete", stretches=stretches, events=events)

    def _all_events(self) -> list[Event]:
        return merge_events(self.earlier + self.events)

    def _status(self, state: str, **fields) -> None:
        write_status(self.folder, state, self.run, self.placement, **fields)
