"""One fit of a planned run: what its workers receive (plan_workers), the TorchTrainer
fitted (fit_on_ray) and its failure turned into one line, and what a fit leaves for the
supervisor (driver/supervisor.py) to read after it: the controller's events, the
trackers it dropped, the metrics parts folded. Runs on the driver.
"""

from __future__ import annotations

from typing import Any, Optional

from ray_ddp.checkpoint.format import started_from_of
from ray_ddp.checkpoint.verify import CheckpointScan
from ray_ddp.cluster.nodes import dead_nodes
from ray_ddp.cluster.placement import Placement
from ray_ddp.cluster.runtime_env import worker_runtime_env
from ray_ddp.config.train import TrainConfig
from ray_ddp.driver.start import planned_steps
from ray_ddp.errors import StorageError, TrainingError
from ray_ddp.record.metrics_table import fold_metrics
from ray_ddp.plan import RunPlan, WorkerPlan
from ray_ddp.record.events import Event, from_records
from ray_ddp.record.failures import describe_loss, summarize_failure
from ray_ddp.record.folder import Progress, RunFolder
from ray_ddp.record.progress import read_progress
from ray_ddp.storage import Storage
from ray_ddp.worker.collectives import start_up_timeout_s


def fold_metrics_after_fit(folder: RunFolder) -> None:
    """metrics.parquet with the parts this fit's callback appended. Where the storage
    fails here the parts stay, for the next fit to fold (every reader reads them
    meanwhile): it must not hide how the fit itself ended."""
    try:
        fold_metrics(folder)
    except (StorageError, OSError):
        pass


def drop_failed_trackers(tracking, folder: RunFolder) -> None:
    """The trackers the fit's controller dropped, dropped here too (progress.json)."""
    try:
        progress = read_progress(folder)
    except StorageError:
        return
    if progress is not None and progress.trackers_failed:
        tracking.drop(progress.trackers_failed)


def controller_events(folder: RunFolder) -> list[Event]:
    """The worker-group restarts the metrics callback saw within one fit (progress.json)."""
    try:
        progress = read_progress(folder)
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


def fit_on_ray(cfg: TrainConfig, store: Storage, placement: Placement,
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

    metrics = MetricsCallback(plan.run.folder, cfg.epochs, plan.last_step,
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
            worker_runtime_env=worker_runtime_env(cfg, placement.gpus_per_worker,
                                                  [v for v in objects.values() if v is not None]),
        ),
    )
    try:
        trainer.fit()
    except TrainingFailedError as err:
        raise _training_error(err, plan.run.folder) from None
    except SystemExit:
        # Ctrl-C: fit() installs Ray's SIGINT handler, which aborts the run gracefully and
        # then leaves fit() with SystemExit. Hand it on as what it was: an interrupt.
        raise KeyboardInterrupt from None


def _training_error(err: Exception, folder: RunFolder) -> TrainingError:
    """One line for the user: the rank that explains the failure (a dead worker or node
    before the survivors' broken connections) and its cause."""
    progress = read_progress(folder) or Progress(0.0)
    failures = getattr(err, "worker_failures", None) or {}
    if not failures:
        text = str(err).strip().splitlines()
        return TrainingError("training failed: " + (text[-1] if text else type(err).__name__))
    failure = summarize_failure(failures, progress.nodes, dead_nodes())
    step = progress.step
    if failure.lost is None:
        return TrainingError(f"training failed on rank {failure.rank}: {failure.cause}", failure, step)
    return TrainingError(describe_loss(failure, step), failure, step)
