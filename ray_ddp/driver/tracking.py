"""The run's trackers on the driver: each one's requirements checked before Ray starts,
the trackers opened (started, or resumed) with the resolved config once the workers are
placed, and finished at the end with the events, the summary, the final model and the
run's status. Runs on the driver; the metrics windows go from Ray Train's controller
(observe/callback.py), the one place that sees them all.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

from ray_ddp.config.train import TrainConfig
from ray_ddp.plan import RunPlan
from ray_ddp.record.progress import read_progress
from ray_ddp.storage import Storage
from ray_ddp.checkpoint.format import MODEL_FILE
from ray_ddp.errors import ConfigError
from ray_ddp.record.events import Event
from ray_ddp.trackers.base import Tracker, Trackers
from ray_ddp.trackers.mlflow import INSTALL_HINT, check_server, open_mlflow
from ray_ddp.trackers.ray_metrics import RayMetricsTracker
from ray_ddp.trackers.tensorboard import TensorBoardTracker
from ray_ddp.trackers.wandb import check_wandb, open_wandb
from ray_ddp.record.folder import run_folder


def check_tracking(cfg: TrainConfig) -> None:
    """One line now, before Ray starts, if mlflow, wandb or an http server is missing."""
    if cfg.mlflow:
        try:
            import mlflow  # noqa: F401
        except ImportError:
            raise ConfigError(INSTALL_HINT) from None
        check_server(cfg.mlflow)
    check_wandb(cfg)


def open_run_tracking(run: RunPlan, identity: str, store: Storage) -> Trackers:
    """The run's trackers: Ray's metrics always, and those the flags name, each the same
    tracker run a resume of this run folder continues (found by the folder's
    ``identity``), its config the one resolved for this cluster."""
    cfg = run.config
    trackers: list[Tracker] = [RayMetricsTracker(cfg.name)]
    try:
        if cfg.mlflow:
            trackers.append(open_mlflow(cfg, run.resolved_options(), identity, store.uri_of(cfg.name)))
        if cfg.wandb:
            trackers.append(open_wandb(cfg, run.resolved_options(), identity, store))
    except ConfigError:  # the one that refused is the line; those opened are not left running
        Trackers(trackers).finish({}, [], "FAILED", None)
        raise
    if cfg.tensorboard:
        trackers.append(TensorBoardTracker(store.path_on_disk(cfg.name)))
    return Trackers(trackers)


def close_run_tracking(trackers: Optional[Trackers], store: Storage, cfg: TrainConfig,
                       summary: Optional[dict], events: list[Event], status: str,
                       echo: Callable[[str], None], fit_over: bool = True) -> None:
    """The events, the summary's numbers and (local storage) the final model.pt; each
    tracker's run ended with ``status``; ``fit_over``: no controller can still be logging
    (a TrainingError comes after Ray Train's fit ended; an interrupt, or Tune ending a
    trial's actor, may leave its controller logging a moment longer).
    A tracker that failed, here or in the controller, is a warning, never an error: the
    run itself is in its folder."""
    if trackers is None:
        return
    model = None
    if summary and summary.get("checkpoint") and store.is_local:
        candidate = os.path.join(store.path_on_disk(cfg.name), summary["checkpoint"].rsplit("/", 1)[-1],
                                 MODEL_FILE)
        model = candidate if os.path.exists(candidate) else None
    trackers.finish(summary or {}, events, status, model, fit_over)
    progress = read_progress(run_folder(store, cfg.name))
    failed = dict.fromkeys(trackers.failed + (progress.trackers_failed if progress else []))
    for label in failed:
        echo(f"warning: {label} did not take all of run {cfg.name} (is it up, and reachable from the cluster?); "
             f"the run's folder holds everything: {store.run_path(cfg.name)}")
