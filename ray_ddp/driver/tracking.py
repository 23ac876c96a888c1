"""--mlflow on the driver: the server checked before Ray starts, the MLflow run opened
with the resolved config once the workers are placed, and at the end the events, the
summary, the final model and the run's status. Runs on the driver; the metrics windows
go from Ray Train's controller (observe/callback.py), the one place that sees them all.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

from ray_ddp.config.train import TrainConfig
from ray_ddp.driver.progress import read_progress
from ray_ddp.storage import StorageConfig
from ray_ddp.checkpoint.format import MODEL_FILE
from ray_ddp.errors import ConfigError
from ray_ddp.driver.events import Event
from ray_ddp.observe.mlflow_tracking import INSTALL_HINT, check_server, finish_tracking, log_events, open_tracking


def check_tracking(cfg: TrainConfig) -> None:
    """One line now, before Ray starts, if mlflow or an http server is missing."""
    if cfg.mlflow:
        try:
            import mlflow  # noqa: F401
        except ImportError:
            raise ConfigError(INSTALL_HINT) from None
        check_server(cfg.mlflow)


def open_run_tracking(cfg: TrainConfig, identity: str, location: str):
    """The run's MLflow run (the same one a resume of this run folder continues, found by
    the folder's ``identity``), its params the config as resolved for this cluster; None
    without --mlflow."""
    if not cfg.mlflow:
        return None

    return open_tracking(cfg.mlflow, cfg.name, cfg.to_dict(), cfg.mlflow_experiment, identity=identity,
                         location=location, parent=cfg.mlflow_parent_run)


def close_run_tracking(tracking, store: StorageConfig, cfg: TrainConfig, summary: Optional[dict],
                       events: list[Event], status: str, echo: Callable[[str], None]) -> None:
    """The events, the summary's numbers and (local storage) the final model.pt; the
    MLflow run ended with ``status``. A server that failed is a warning, never an error:
    the run itself is in its folder."""
    if tracking is None:
        return

    run_path = store.run_path(cfg.name)
    model = None
    if summary and summary.get("checkpoint") and store.is_local:
        candidate = os.path.join(store.path_on_disk(cfg.name), summary["checkpoint"].rsplit("/", 1)[-1],
                                 MODEL_FILE)
        model = candidate if os.path.exists(candidate) else None
    ok = log_events(tracking, events) if events else True
    ok = finish_tracking(tracking, summary or {}, status, model) and ok
    progress = read_progress(store, run_path)
    ok = ok and not (progress and progress.mlflow_failed)
    if not ok:
        echo(f"warning: MLflow at {cfg.mlflow} did not take all of run {cfg.name} (is the server up?); "
             f"the run's folder holds everything: {run_path}")
