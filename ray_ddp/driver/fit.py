"""TorchTrainer.fit() for a planned run: the trainer built, progress shown, status.json
kept, a failure turned into one line, and the driver's own restarts. Runs on the
driver.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional
from ray_ddp.checkpoint.format import started_from_of
from ray_ddp.checkpoint.verify import CheckpointScan, find_latest_checkpoint
from ray_ddp.config.train import TrainConfig
from ray_ddp.plan import RunPlan, WorkerPlan
from ray_ddp.cluster.placement import PlacementConfig
from ray_ddp.record.events import (Event, attribute_hangs, failure_event, from_records, merge_events,
                                   restarted_after_hang, steps_to_redo, table_events)
from ray_ddp.driver.hangs import HangMonitor
from ray_ddp.record.failures import describe_loss, summarize_failure
from ray_ddp.driver.restart_decision import RestartDecision, RestartPolicyConfig, RestartState, decide_restart
from ray_ddp.cluster.runtime_env import nccl_hang_env, train_controller_env, worker_runtime_env
from ray_ddp.record.progress import read_progress, show_progress
from ray_ddp.record.folder import Progress, RunFolder
from ray_ddp.storage import StorageConfig
from ray_ddp.driver.start import StartState, planned_steps
from ray_ddp.record.status import read_events, write_status
from ray_ddp.errors import StorageError, TrainingError
from ray_ddp.worker.collectives import start_up_timeout_s
from ray_ddp.observe.metrics_table import fold_metrics, read_metrics
from ray_ddp.observe.summarize import world_stretches


def fit_with_status(run: RunPlan, store: StorageConfig, placement: PlacementConfig,
                    start: StartState, objects: dict[str, Any], echo: Callable[[str], None], *,
                    init_from: Optional[str] = None, model_loss: bool = False, tracking=None,
                    ray_inputs=None, fit: Optional[Callable[..., None]] = None) -> None:
    """TorchTrainer.fit() with progress shown, and status.json telling where it stands;
    started again from the newest checkpoint when ``failures`` says the run goes on.
    ``init_from``: a new run's first weights; ``model_loss``: batches hand the model its
    labels (WorkerPlan); ``tracking``: the run's Trackers; ``ray_inputs``: the trainer's Ray
    Datasets, their DataConfig and the workers' RayDataConfig (data/ray_data.py);
    ``fit``: what runs the workers, ``fit_on_ray`` (a TorchTrainer) unless the caller
    brings its own (the tests' gloo harness: plain processes, for ray_ddp's own code)."""
    cfg = run.run_config()  # the options the run trains with (status.json shows them)
    run_path = run.folder.path
    scan = start.scan
    restarts = RestartState()
    policy = RestartPolicyConfig(placement.elastic, cfg.max_failures, cfg.max_preemptions)
    earlier = read_events(store, run_path)  # of the commands before this one
    events: list[Event] = []  # this command's
    pending: list[Event] = []  # hangs that ended a fit (no restart within it followed)
    write_status(store, run_path, "running", cfg, placement, run_id=start.run_id)
    monitor = HangMonitor(cfg.hang_timeout, store, run_path, echo, cfg.wait_timeout)
    try:
        while True:
            try:
                try:
                    with show_progress(store, run_path, echo, enabled=not cfg.quiet,
                                       hangs=lambda: list(monitor.hangs)), \
                            train_controller_env(nccl_hang_env(placement.backend, cfg.hang_timeout)):
                        plan = plan_workers(run, scan, objects, init_from, model_loss, monitor.actor,
                                            ray_inputs[2] if ray_inputs else None)
                        # the steps an earlier fit's controller logged (it is gone): not logged twice
                        if tracking is not None:
                            tracking.resume()
                        (fit or fit_on_ray)(cfg, store, placement, plan, objects, tracking, ray_inputs)
                finally:  # the restarts Ray Train made within this fit, before the next overwrites them
                    told, pending = attribute_hangs(controller_events(store, run_path), monitor.take_hangs())
                    events.extend(told)
                    if tracking is not None:
                        drop_failed_trackers(tracking, store, run_path)
                        for hang in (e for e in told if e.type == "hang"):
                            # the controller counted the restart of its event; the hang is the driver's
                            tracking.log_event(dataclasses.replace(hang, restarted=False))
                    fold_metrics_after_fit(store, run.folder)
                break
            except TrainingError as err:
                if pending and err.failure is not None:  # the watch ended the group: say why
                    err.args = (pending[-1].cause.removeprefix("hang: "),)
                scan = find_latest_checkpoint(store.fs, run_path, verify_crc=True)
                decision = _decide_restart(err, restarts, policy, store, run_path, scan)
                if decision is None:  # Ray's controller failed: no rank to name, nothing to decide
                    raise
                restarts = decision.state
                event = failure_event(err.failure, err.step, decision.restart, scan.latest,
                                      preemption=decision.preemption)
                if pending:
                    event = restarted_after_hang(pending[-1], event)
                events.append(event)
                if tracking is not None:
                    tracking.log_event(event)
                if not decision.restart:
                    err.args = (str(err) + decision.reason,)
                    raise
                echo(f"{err}; restarting from {scan.latest or 'scratch'} ({decision.reason})"
                     + _steps_to_redo(err.step, scan.meta))
                write_status(store, run_path, "running", cfg, placement,
                             events=merge_events(earlier + events))
    except TrainingError as err:
        write_status(store, run_path, "failed", cfg, placement, error=str(err),
                     events=merge_events(earlier + events))
        raise
    except KeyboardInterrupt:
        write_status(store, run_path, "interrupted", cfg, placement)
        raise
    except BaseException as err:  # a bug or a storage failure: never leave "running"
        write_status(store, run_path, "failed", cfg, placement, error=f"{type(err).__name__}: {err}")
        raise
    finally:
        monitor.close()

    table = read_metrics(store.fs, run.folder)
    stretches = world_stretches(table) if table is not None and table.num_rows else None
    # the table holds the whole run: its preemptions and resizes, earlier commands' too
    write_status(store, run_path, "complete", cfg, placement, stretches=stretches,
                 events=merge_events(earlier + events, table_events(table.to_pylist(), stretches or []))
                 if table is not None else merge_events(earlier + events))


def fold_metrics_after_fit(store: StorageConfig, folder: RunFolder) -> None:
    """metrics.parquet with the parts this fit's callback appended. Where the storage
    fails here the parts stay, for the next fit to fold (every reader reads them
    meanwhile): it must not hide how the fit itself ended."""
    try:
        fold_metrics(store.fs, folder)
    except (StorageError, OSError):
        pass


def drop_failed_trackers(tracking, store: StorageConfig, run_path: str) -> None:
    """The trackers the fit's controller dropped, dropped here too (progress.json)."""
    try:
        progress = read_progress(store, run_path)
    except StorageError:
        return
    if progress is not None and progress.trackers_failed:
        tracking.drop(progress.trackers_failed)


def controller_events(store: StorageConfig, run_path: str) -> list[Event]:
    """The worker-group restarts the metrics callback saw within one fit (progress.json)."""
    try:
        progress = read_progress(store, run_path)
    except StorageError:  # a failed read must not end a fit that succeeded (nor hide how one failed)
        return []
    return from_records(progress.events) if progress else []


def plan_workers(run: RunPlan, scan: CheckpointScan, objects: dict[str, Any],
                 init_from: Optional[str] = None, model_loss: bool = False,
                 hang_watch: Any = None, ray_data: Any = None) -> WorkerPlan:
    """All a worker receives: the run's plan, where to resume, where the run ends, and
    the Python API's objects, pickled here (Ray Train's controller only hands them on,
    and could not import a user's module that only the workers' PYTHONPATH holds)."""
    from ray import cloudpickle

    return WorkerPlan(run=run, resume_from=scan.latest, newest_at_start=scan.newest,
                      total_steps=planned_steps(run.config.epochs, run.steps_per_epoch, scan.meta),
                      objects=cloudpickle.dumps({k: v for k, v in objects.items() if v is not None}),
                      model_loss=model_loss,
                      # only before this run's first checkpoint: a restart resumes it instead
                      init_from=init_from if scan.latest is None else None, init_strict=run.config.init_strict,
                      started_from=init_from if scan.meta is None else started_from_of(scan.meta),
                      hang_watch=hang_watch, ray_data=ray_data)


def _decide_restart(err: TrainingError, restarts: RestartState, policy: RestartPolicyConfig,
                    store: StorageConfig, run_path: str, scan: CheckpointScan) -> Optional[RestartDecision]:
    """decide_restart for a fit that ended in ``err``, with the nodes progress.json knows
    (those preempted, those the ranks ran on); None when no rank explains the failure."""
    if err.failure is None:
        return None
    progress = read_progress(store, run_path) or Progress(0.0)
    preempted = {n for p in progress.preemptions for n in str(p.get("node_id", "")).split(",") if n}
    run_nodes = {str(n) for n in progress.nodes.values() if n}
    return decide_restart(err.failure, policy, restarts, preempted, run_nodes, scan.latest)


def _steps_to_redo(step: Optional[int], meta: Optional[dict[str, Any]]) -> str:
    if step is None:
        return ""
    return steps_to_redo(step - (meta["step"] if meta else 0))


def fit_on_ray(cfg: TrainConfig, store: StorageConfig, placement: PlacementConfig,
               plan: WorkerPlan, objects: dict[str, Any], tracking=None, ray_inputs=None) -> None:
    """One TorchTrainer.fit() of the planned workers, its failure as a TrainingError."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchConfig

    # here, not at the top: these import Ray Train, which the driver loads only to fit (`ray-ddp --help`
    # and the checks before Ray starts import this module)
    from ray_ddp.driver.trainer import RayDdpTrainer
    from ray_ddp.worker.loop import train_loop_per_worker
    from ray_ddp.observe.callback import MetricsCallback
    from ray_ddp.observe.restarts import RestartRecorder

    metrics = MetricsCallback(store.uri, cfg.name, cfg.epochs, plan.last_step,
                              keep=cfg.keep, keep_best=cfg.keep_best, trackers=tracking)
    trainer = RayDdpTrainer(
        train_loop_per_worker,
        train_loop_config=plan,
        **({"datasets": ray_inputs[0], "dataset_config": ray_inputs[1]} if ray_inputs else {}),
        # the process group's timeout: longer than the hang watch's patience for the first
        # step, then (after each worker's first step) its patience after (worker/collectives.py)
        torch_config=TorchConfig(backend=placement.backend, timeout_s=int(start_up_timeout_s(cfg.hang_timeout, cfg.wait_timeout))),
        scaling_config=ScalingConfig(
            num_workers=placement.num_workers(),  # (MIN, MAX): Ray's elastic policy
            use_gpu=placement.use_gpu,
            resources_per_worker=placement.resources_per_worker(),
        ),
        run_config=RunConfig(
            name=cfg.name,
            storage_path=store.uri,
            # with --keep-best, the metrics callback prunes (newest --keep and the best)
            checkpoint_config=CheckpointConfig(num_to_keep=None if cfg.keep_best else cfg.keep),
            # a preemption restart is counted apart from failures (Ray tells them apart)
            failure_config=FailureConfig(max_failures=cfg.max_failures or 0,
                                         max_preemption_failures=cfg.max_preemptions),
            # the recorder holds the metrics callback: one pickle, so one object in the controller
            callbacks=[metrics, RestartRecorder(metrics, plan.hang_watch, plan.resume_from)],
            worker_runtime_env=worker_runtime_env(cfg, [v for v in objects.values() if v is not None]),
        ),
    )
    try:
        trainer.fit()
    except TrainingFailedError as err:
        raise _training_error(err, store.run_path(cfg.name), store) from None
    except SystemExit:
        # Ctrl-C: fit() installs Ray's SIGINT handler, which aborts the run gracefully and
        # then leaves fit() with SystemExit. Hand it on as what it was: an interrupt.
        raise KeyboardInterrupt from None


def _training_error(err: Exception, run_path: str, store: StorageConfig) -> TrainingError:
    """One line for the user: the rank that explains the failure (a dead worker or node
    before the survivors' broken connections) and its cause."""
    progress = read_progress(store, run_path) or Progress(0.0)
    failures = getattr(err, "worker_failures", None) or {}
    if not failures:
        text = str(err).strip().splitlines()
        return TrainingError("training failed: " + (text[-1] if text else type(err).__name__))
    failure = summarize_failure(failures, progress.nodes)
    step = progress.step
    if failure.lost is None:
        return TrainingError(f"training failed on rank {failure.rank}: {failure.cause}", failure, step)
    return TrainingError(describe_loss(failure, step), failure, step)
