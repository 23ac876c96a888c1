"""Where a run starts: the newest whole checkpoint, whether this command may resume
from it, and whether anything is left to train (its epochs all done, or --early-stop
ended it there). Runs on the driver.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional
from ray_ddp.checkpoint.retention import drop_unfinished
from ray_ddp.checkpoint.verify import CheckpointScan, find_latest_checkpoint
from ray_ddp.errors import ConfigError
from ray_ddp.config.train import TrainConfig
from ray_ddp.record.status import new_run_id, read_run_id
from ray_ddp.storage import Storage
from ray_ddp.record.metrics_table import read_metrics
from ray_ddp.observe.summarize import early_stop_row
from ray_ddp.plan import RunPlan, saved_run_config
from ray_ddp.record.names import RESUME_KEYS
from ray_ddp.config.choices import SHARDED_STRATEGIES
from ray_ddp.record.folder import run_folder


@dataclass(frozen=True)
class StartState:
    """Where a run starts: the checkpoint scan, the resumed folder's URI (None for a new
    run), whether the run is already complete, and the run folder's own id (status.json's,
    or a new one that the first status.json keeps)."""

    scan: CheckpointScan
    resumed_from: Optional[str]
    complete: bool
    run_id: str = ""


def find_start(run: RunPlan, store: Storage, data_shape, echo: Callable[[str], None]) -> StartState:
    """The newest whole checkpoint of the run (every file checked), whether this command
    can resume from it, and whether there is anything left to train."""
    cfg = run.config
    folder = run_folder(store, cfg.name)
    scan = find_latest_checkpoint(folder, verify_crc=True)
    _say_broken(cfg, scan, echo)
    scan = drop_unfinished(folder, scan)  # the run goes on (_say_broken did not stop it)
    resumed_from = store.uri_of(cfg.name, scan.latest) if scan.latest else None
    complete = False
    if scan.meta is not None:
        check_resumable(run, scan.meta, scan.latest,
                         data_decides_steps=data_shape is not None and data_shape.rows > 0)
        if scan.meta["epoch"] >= cfg.epochs:
            echo(f"run {cfg.name} is already complete ({scan.meta['epoch']}/{cfg.epochs} epochs); "
                 "nothing to do (raise --epochs to train further)")
            complete = True
        elif cfg.max_steps is not None and scan.meta["step"] >= cfg.max_steps:
            echo(f"run {cfg.name} is already complete (step {scan.meta['step']}, --max-steps "
                 f"{cfg.max_steps}); nothing to do (raise --max-steps to train further)")
            complete = True
        elif ended_by_early_stop(cfg, store, scan.meta):
            saved = scan.meta["config"]["early_stop"]
            echo(f"run {cfg.name} is already complete: --early-stop {saved} ended it after epoch "
                 f"{scan.meta['epoch']} of {cfg.epochs}; nothing to do (give a larger --early-stop "
                 "to train further)")
            complete = True
    return StartState(scan, resumed_from, complete, read_run_id(run_folder(store, cfg.name)) or new_run_id())


def ended_by_early_stop(cfg: TrainConfig, store: Storage, meta: dict[str, Any]) -> bool:
    """Whether --early-stop ended the run at this checkpoint, so that this command has
    nothing left to do: the metrics row of the checkpoint's step says so
    (``early_stopped``; the table and its parts get each checkpoint's rows, so they hold that
    row), and this command does not give a larger --early-stop (which would resume and
    count on, from the validations so far: worker/validate.py)."""
    saved = meta.get("config", {}).get("early_stop")
    if not saved or (cfg.early_stop is not None and cfg.early_stop > saved):
        return False

    table = read_metrics(run_folder(store, cfg.name))
    return early_stop_row(table, meta["step"]) is not None


def check_resumable(run: RunPlan, meta: dict[str, Any], dir_name: str, data_decides_steps: bool) -> None:
    """Refuse, in one line, a resume whose model shape, strategy or cut of the epoch is
    not the checkpoint's: the checkpoint's resolved options against this command's."""
    cfg, saved, given = run.config, saved_run_config(meta), run.resolved_options()
    steps = run.steps_per_epoch
    for key in RESUME_KEYS:
        if key in saved and not _same_for_resume(key, saved[key], given[key]):
            raise ConfigError(
                f"run {cfg.name} was trained with {key}={saved[key]!r} but this command has "
                f"{key}={given[key]!r}; use the same value to resume, or a new --name"
            )
    if not data_decides_steps and steps != saved.get("steps_per_epoch", steps):
        raise ConfigError(
            f"run {cfg.name} has steps_per_epoch={saved['steps_per_epoch']} in {dir_name}; "
            "resume with the same --steps-per-epoch, or use a new --name"
        )
    # a mid-epoch checkpoint (a step or time cadence, a preemption) names its step within
    # the epoch: with other steps per epoch, that step holds other rows (or is past the end)
    if meta.get("epoch_step", 0) and steps != saved.get("steps_per_epoch", steps):
        raise ConfigError(
            f"run {cfg.name}'s {dir_name} was taken at step {meta['epoch_step']} of epoch "
            f"{meta['epoch'] + 1}'s {saved['steps_per_epoch']} steps, and this command makes "
            f"{steps} steps an epoch (another global batch, --batch-size or data); "
            "resume with the same ones to finish that epoch, or use a new --name"
        )


def _same_for_resume(key: str, saved: Any, given: Any) -> bool:
    """fsdp and hsdp write the same sharded checkpoints (DCP's), so either resumes the other."""
    if key == "strategy":
        return (saved in SHARDED_STRATEGIES) == (given in SHARDED_STRATEGIES)
    return saved == given


def _say_broken(cfg: TrainConfig, scan: CheckpointScan, echo: Callable[[str], None]) -> None:
    """Name every unusable checkpoint newer than the one we resume from. With none to
    resume from, start from scratch when none was ever finished (a worker killed while
    the run's first checkpoint was uploading: the same command goes on, as after a loss
    before any checkpoint), else stop: a finished checkpoint lost its files."""
    never_finished = scan.latest is None and len(scan.unfinished) == len(scan.broken)
    stops = scan.latest is None and not never_finished
    for name, problem in scan.broken:
        removed = " (its folder is removed: it never held a checkpoint)" if name in scan.unfinished and not stops \
            else ""
        then = f"; resuming from {scan.latest} instead" if scan.latest else \
            "; starting from scratch: no checkpoint of the run was finished" if never_finished else ""
        echo(f"warning: checkpoint {name} of run {cfg.name} is unusable: {problem}{removed}{then}")
    if scan.broken and stops:
        name, problem = scan.broken[-1]
        raise ConfigError(
            f"run {cfg.name} has no usable checkpoint ({name}: {problem}); "
            "delete the run folder to start over, or use a new --name"
        )


def planned_steps(epochs: int, steps_per_epoch: int, meta: Optional[dict[str, Any]]) -> int:
    """The global step the run ends at: the steps a resumed run already took, plus what
    is left at this run's steps per epoch (another world size or batch may give other
    steps per epoch than the checkpoint's run had)."""
    if meta is None:
        return epochs * steps_per_epoch
    return meta["step"] - meta.get("epoch_step", 0) + (epochs - meta["epoch"]) * steps_per_epoch
