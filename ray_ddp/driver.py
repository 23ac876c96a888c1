"""run(cfg) -> RunSummary: everything ``ray-ddp train`` does, on the driver.

In order: validate the config and the model (before Ray starts, so a mistake costs
seconds), resolve the storage and the run's folder, stop at once if the run is already
complete, attach to Ray (or start a local one), plan the placement and check that the
cluster can ever hold it, run TorchTrainer.fit() while printing progress, and write
``summary.json`` from the metrics table the controller left in the run folder.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Optional

from .checkpoint import CheckpointScan, find_latest_checkpoint
from .config import ConfigError, TrainConfig
from .devices import PlacementConfig, plan_placement
from .models import check_model, model_stages
from .storage import (METRICS_FILE, PROGRESS_FILE, SUMMARY_FILE, StorageConfig, check_writable,
                      read_json, read_table, resolve_storage, write_json)

# Fields of the checkpoint's config that must match for a resume to load the weights.
_SHAPE_KEYS = ("model", "input_dim", "output_dim", "width", "depth")


class TrainingError(RuntimeError):
    """Training started but failed; the message names the failing rank and cause."""


@dataclass
class RunSummary:
    """What a run left behind; ``--json`` prints it, ``summary.json`` stores it."""

    run: str
    path: str
    world_size: int
    gpus_per_worker: int
    epochs_completed: int
    final_loss: Optional[float]
    samples_per_s: Optional[float]
    checkpoint: Optional[str]
    metrics: Optional[str]
    resumed_from: Optional[str]
    epochs: int = 0
    steps: int = 0
    backend: str = ""
    wall_time_s: float = 0.0
    already_complete: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run(cfg: TrainConfig, echo: Callable[[str], None] = print) -> RunSummary:
    """Train as ``cfg`` says and return the summary; raises ConfigError on a user mistake."""
    started = time.time()
    cfg = _with_default_name(cfg.validate())
    check_model(cfg)
    store = resolve_storage(cfg.storage)
    check_writable(store)
    run_path = store.run_path(cfg.name)
    scan = find_latest_checkpoint(store.fs, run_path)
    _say_broken(cfg, scan, echo)
    resumed_from = f"{_join(store.uri, cfg.name)}/{scan.latest}" if scan.latest else None
    if scan.meta is not None:
        _check_resumable(cfg, scan.meta, scan.latest)
        if scan.meta["epoch"] >= cfg.epochs:
            echo(f"run {cfg.name} is already complete ({scan.meta['epoch']}/{cfg.epochs} epochs); "
                 "nothing to do (raise --epochs to train further)")
            summary = read_json(store.fs, f"{run_path}/{SUMMARY_FILE}")
            if summary is not None:
                return RunSummary(**{**summary, "already_complete": True})
            return _write_summary(cfg, store, None, resumed_from, started)

    with _ray_session(cfg) as node_gpus:
        placement = plan_placement(cfg.workers, cfg.gpus_per_worker, cfg.backend, node_gpus,
                                   stages=model_stages(cfg.model))
        _preflight(placement)
        cfg.workers, cfg.gpus_per_worker, cfg.backend = (
            placement.workers, placement.gpus_per_worker, placement.backend)
        if not cfg.quiet:
            where = f"resuming from {resumed_from}" if resumed_from else "new run"
            echo(f"ray_ddp: run {cfg.name} ({where}): {placement.describe()}, model {cfg.model}, "
                 f"global batch {placement.workers * cfg.batch_size}, {cfg.epochs} epochs x "
                 f"{cfg.steps_per_epoch} steps -> {run_path}")
        with _show_progress(store, run_path, echo, enabled=not cfg.quiet):
            _fit(cfg, store, placement, scan.latest)

    return _write_summary(cfg, store, placement, resumed_from, started)


def _with_default_name(cfg: TrainConfig) -> TrainConfig:
    if cfg.name is None:
        cfg.name = time.strftime("ray_ddp-%Y%m%d-%H%M%S")
    return cfg


def _join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}"


def _check_resumable(cfg: TrainConfig, meta: dict[str, Any], dir_name: str) -> None:
    saved = meta.get("config", {})
    for key in _SHAPE_KEYS:
        if key in saved and saved[key] != getattr(cfg, key):
            raise ConfigError(
                f"run {cfg.name} was trained with {key}={saved[key]!r} but this command has "
                f"{key}={getattr(cfg, key)!r}; use the same value to resume, or a new --name"
            )
    if cfg.steps_per_epoch != saved.get("steps_per_epoch", cfg.steps_per_epoch):
        raise ConfigError(
            f"run {cfg.name} has steps_per_epoch={saved['steps_per_epoch']} in {dir_name}; "
            "resume with the same --steps-per-epoch, or use a new --name"
        )


@contextmanager
def _ray_session(cfg: TrainConfig) -> Iterator[list[int]]:
    """Attach to Ray (``--address``, RAY_ADDRESS, or an already initialized Ray) or start
    a local one; yield the GPU count of each alive node; shut down only what we started."""
    import ray

    started_here = False
    if not ray.is_initialized():
        address = cfg.address or os.environ.get("RAY_ADDRESS")
        kwargs: dict[str, Any] = dict(
            log_to_driver=cfg.verbose,
            logging_level=logging.INFO if cfg.verbose else logging.ERROR,
            include_dashboard=False if address is None else None,
        )
        if address is None:
            # A private local Ray: listening on loopback only, with as many CPU slots as
            # workers asked for, so it never waits.
            want = cfg.workers or 0
            kwargs["num_cpus"] = max(os.cpu_count() or 1, want)
            kwargs["_node_ip_address"] = "127.0.0.1"
            address = "local"
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        ray.init(address=address, **kwargs)
        started_here = True
    try:
        yield [int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")]
    finally:
        if started_here:
            ray.shutdown()


def _preflight(placement: PlacementConfig) -> None:
    """Refuse a job the cluster can never hold (Ray Train would wait for it forever)."""
    import ray

    slots = 0
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    for res in nodes:
        fits = int(res.get("CPU", 0) // placement.cpus_per_worker)
        if placement.use_gpu:
            fits = min(fits, int(res.get("GPU", 0) // placement.gpus_per_worker))
        slots += fits
    if slots >= placement.workers:
        return
    total_cpu = sum(r.get("CPU", 0) for r in nodes)
    total_gpu = sum(r.get("GPU", 0) for r in nodes)
    if placement.use_gpu:
        need = (f"needs {placement.workers} workers x {placement.gpus_per_worker} GPU = "
                f"{placement.workers * placement.gpus_per_worker} GPU")
        have = f"the cluster has {total_gpu:g} GPU"
        if placement.gpus_per_worker > 1 and total_gpu >= placement.workers * placement.gpus_per_worker:
            have += f" but not {placement.gpus_per_worker} on one node for each worker"
        hint = "; pass --gpus-per-worker 0 to train on CPU" if total_gpu == 0 else "; lower --workers"
    else:
        need = (f"needs {placement.workers} workers x {placement.cpus_per_worker} CPU = "
                f"{placement.workers * placement.cpus_per_worker} CPU")
        have = f"the cluster has {total_cpu:g} CPU"
        hint = "; lower --workers"
    raise ConfigError(f"{need}; {have}{hint}")


def _say_broken(cfg: TrainConfig, scan: CheckpointScan, echo: Callable[[str], None]) -> None:
    """Name every unusable checkpoint newer than the one we resume from, or stop."""
    for name, problem in scan.broken:
        then = f"; resuming from {scan.latest} instead" if scan.latest else ""
        echo(f"warning: checkpoint {name} of run {cfg.name} is unusable: {problem}{then}")
    if scan.broken and scan.latest is None:
        name, problem = scan.broken[-1]
        raise ConfigError(
            f"run {cfg.name} has no usable checkpoint ({name}: {problem}); "
            "delete the run folder to start over, or use a new --name"
        )


def _fit(cfg: TrainConfig, store: StorageConfig, placement: PlacementConfig,
         resume_from: Optional[str]) -> None:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchConfig, TorchTrainer

    from .loop import train_loop_per_worker
    from .metrics import MetricsCallback

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": cfg.to_dict(), "resume_from": resume_from},
        torch_config=TorchConfig(backend=placement.backend),
        scaling_config=ScalingConfig(
            num_workers=placement.workers,
            use_gpu=placement.use_gpu,
            resources_per_worker=placement.resources_per_worker(),
        ),
        run_config=RunConfig(
            name=cfg.name,
            storage_path=store.uri,
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep),
            failure_config=FailureConfig(max_failures=cfg.max_failures),
            callbacks=[MetricsCallback(store.uri, cfg.name, cfg.epochs, cfg.steps_per_epoch)],
            worker_runtime_env=worker_runtime_env(cfg),
        ),
    )
    try:
        trainer.fit()
    except TrainingFailedError as err:
        raise TrainingError(_describe_failure(err)) from None
    except SystemExit:
        # Ctrl-C: fit() installs Ray's SIGINT handler, which aborts the run gracefully and
        # then leaves fit() with SystemExit. Hand it on as what it was: an interrupt.
        raise KeyboardInterrupt from None


def worker_runtime_env(cfg: TrainConfig) -> dict[str, Any]:
    """The one place that sets workers' environment: nothing, except that a user model
    (``package.module:callable``) must import on the workers as it did here, so the
    folder it was imported from goes on their PYTHONPATH. (Under ``ray job submit`` the
    job's working_dir is on it already; on a multi-node cluster that folder must exist on
    every node, as a shared filesystem or the job's working_dir provides.)"""
    if ":" not in cfg.model:
        return {}
    import importlib

    top = cfg.model.split(":")[0].split(".")[0]
    module = importlib.import_module(top)
    origin = getattr(module, "__file__", None)
    if origin is None:
        return {}
    root = os.path.dirname(os.path.abspath(origin))
    if os.path.basename(origin) == "__init__.py":
        root = os.path.dirname(root)  # a package: its parent folder is what goes on the path
    paths = [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}}


def _describe_failure(err: Exception) -> str:
    """One line for the user: the first failing rank and its exception's last line."""
    failures = getattr(err, "worker_failures", None) or {}
    if failures:
        rank = min(failures)
        cause = failures[rank]
        last = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
        return f"training failed on rank {rank}: {last}"
    text = str(err).strip().splitlines()
    return "training failed: " + (text[-1] if text else type(err).__name__)


@contextmanager
def _show_progress(store: StorageConfig, run_path: str, echo: Callable[[str], None],
                   enabled: bool, every_s: float = 1.0) -> Iterator[None]:
    """Poll the controller's progress.json and print a line for each new report."""
    if not enabled:
        yield
        return
    stop = threading.Event()
    first_seen = read_json(store.fs, f"{run_path}/{PROGRESS_FILE}")
    last_time = first_seen["time"] if first_seen else None

    def show_new() -> None:
        nonlocal last_time
        p = read_json(store.fs, f"{run_path}/{PROGRESS_FILE}")
        if p is None or p["time"] == last_time:
            return
        last_time = p["time"]
        echo(format_progress(p))

    def poll() -> None:
        while not stop.wait(every_s):
            show_new()

    thread = threading.Thread(target=poll, name="ray_ddp-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        show_new()


def format_progress(p: dict[str, Any]) -> str:
    line = (f"epoch {p['epoch']}/{p['epochs']}  step {p['step']}/{p['total_steps']}  "
            f"loss {p['loss']:.4f}  {p['samples_per_s']:,.0f} samples/s")
    if p.get("checkpoint"):
        line += f"  saved {p['checkpoint']}"
    return line


def _write_summary(cfg: TrainConfig, store: StorageConfig, placement: Optional[PlacementConfig],
                   resumed_from: Optional[str], started: float) -> RunSummary:
    from .metrics import summarize_metrics

    run_path = store.run_path(cfg.name)
    run_uri = _join(store.uri, cfg.name)
    scan = find_latest_checkpoint(store.fs, run_path)
    meta = scan.meta or {}
    saved_cfg = meta.get("config", {})
    table = read_table(store.fs, f"{run_path}/{METRICS_FILE}")
    stats = summarize_metrics(table) if table is not None and table.num_rows else {}
    summary = RunSummary(
        run=cfg.name,
        path=run_uri,
        world_size=placement.workers if placement else meta.get("world_size", 0),
        gpus_per_worker=placement.gpus_per_worker if placement else saved_cfg.get("gpus_per_worker", 0),
        epochs_completed=meta.get("epoch", 0),
        final_loss=stats.get("final_loss"),
        samples_per_s=stats.get("samples_per_s"),
        checkpoint=f"{run_uri}/{scan.latest}" if scan.latest else None,
        metrics=f"{run_uri}/{METRICS_FILE}" if table is not None else None,
        resumed_from=resumed_from,
        epochs=cfg.epochs,
        steps=meta.get("step", 0),
        backend=placement.backend if placement else saved_cfg.get("backend", ""),
        wall_time_s=round(time.time() - started, 3),
    )
    write_json(store.fs, f"{run_path}/{SUMMARY_FILE}", summary.to_dict())
    return summary
