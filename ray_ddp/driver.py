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
import sys
import time
from contextlib import contextmanager
import dataclasses
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Optional

from .checkpoint import CheckpointScan, find_latest_checkpoint
from .config import ConfigError, TrainConfig
from .devices import PlacementConfig, plan_placement
from .models import check_model, model_stages
from .preflight import ensure_cluster_fits
from .progress import show_progress
from .storage import (METRICS_FILE, STATUS_FILE, SUMMARY_FILE, StorageConfig, check_writable,
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
    startup_s: Optional[dict[str, float]] = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run(cfg: TrainConfig, echo: Callable[[str], None] = print) -> RunSummary:
    """Train as ``cfg`` says and return the summary. Raises ConfigError on a user mistake
    (before anything is written) and TrainingError when training failed. ``cfg`` itself is
    left as it was: the defaults filled in here go to a copy."""
    started = time.time()
    marks = {"process": _process_start_time(started), "run": started}  # start-up timeline
    cfg = _with_default_name(dataclasses.replace(cfg).validate())
    data_shape = inspect_data(cfg)  # before Ray starts: bad data costs seconds
    _fit_data_to(cfg, data_shape, cfg.workers or 1)  # redone below for the real world size
    check_model(cfg)
    store = resolve_storage(cfg.storage)
    check_writable(store)
    if cfg.tensorboard and not store.is_local:
        raise ConfigError(f"--tensorboard writes event files to a local disk; --storage {cfg.storage} "
                          "is not one (use a local or shared path, or drop --tensorboard)")
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

    marks["attach"] = time.time()
    local = cfg.address is None and not os.environ.get("RAY_ADDRESS")
    with attach_ray(cfg.address, cfg.verbose,
                    local_cpus=(cfg.workers or 0) * (cfg.cpus_per_worker or 1)) as node_gpus:
        marks["ray"] = time.time()
        placement = plan_placement(cfg.workers, cfg.gpus_per_worker, cfg.backend, node_gpus,
                                   stages=model_stages(cfg.model), cpus_per_worker=cfg.cpus_per_worker,
                                   local_cpus=os.cpu_count() if local else None)
        _fit_data_to(cfg, data_shape, placement.workers)
        if cfg.amp == "fp16" and not placement.use_gpu:
            raise ConfigError("--amp fp16 needs GPUs and this run is on CPU; use --amp bf16")
        ensure_cluster_fits(placement, cfg.wait_for_resources, echo)
        cfg.workers, cfg.gpus_per_worker, cfg.cpus_per_worker, cfg.backend = (
            placement.workers, placement.gpus_per_worker, placement.cpus_per_worker, placement.backend)
        if not cfg.quiet:
            where = f"resuming from {resumed_from}" if resumed_from else "new run"
            echo(f"ray_ddp: run {cfg.name} ({where}): {placement.describe()}, model {cfg.model}, "
                 f"global batch {describe_global_batch(cfg, placement.workers)}, {cfg.epochs} "
                 f"epochs x {cfg.steps_per_epoch} steps -> {run_path}")
        _write_status(store, run_path, "running", cfg, placement)
        marks["fit"] = time.time()
        try:
            with show_progress(store, run_path, echo, enabled=not cfg.quiet):
                _fit(cfg, store, placement, scan.latest)
        except TrainingError as err:
            _write_status(store, run_path, "failed", cfg, placement, error=str(err))
            raise
        except KeyboardInterrupt:
            _write_status(store, run_path, "interrupted", cfg, placement)
            raise

    _write_status(store, run_path, "complete", cfg, placement)
    return _write_summary(cfg, store, placement, resumed_from, started, marks)


@dataclass(frozen=True)
class DataShapeConfig:
    """What --data / --dataset decide for the run: rows, and the model's input and
    output sizes. Taken once on the driver (a user's Dataset is built once here)."""

    rows: int
    input_dim: int
    output_dim: int


def inspect_data(cfg: TrainConfig) -> Optional[DataShapeConfig]:
    """Check --data / --dataset before Ray starts (one line if unusable); None for synthetic."""
    if cfg.data != "synthetic":
        from .datasets import inspect_table

        table = inspect_table(cfg.data, cfg.features, cfg.target)
        return DataShapeConfig(table.rows, table.input_dim, table.output_dim)
    if cfg.dataset is not None:
        from .datasets import load_user_dataset

        ds = load_user_dataset(cfg.dataset)
        x, y = ds[0]
        return DataShapeConfig(len(ds), int(torch_numel(x)), int(torch_numel(y)))
    return None


def _fit_data_to(cfg: TrainConfig, shape: Optional[DataShapeConfig], workers: int) -> None:
    """With --data / --dataset, the data decides the model's dims and the steps per epoch
    (one pass over the rows, which depends on the world size)."""
    from .data import steps_for_rows, stream_steps

    if shape is None:
        return
    cfg.input_dim, cfg.output_dim = shape.input_dim, shape.output_dim
    if cfg.dataset is not None:
        per_rank = -(-shape.rows // workers)  # DistributedSampler pads to equal shares
        cfg.steps_per_epoch = steps_for_rows(per_rank, 1, cfg.batch_size, cfg.grad_accum)
    else:
        steps = stream_steps if cfg.stream else steps_for_rows
        cfg.steps_per_epoch = steps(shape.rows, workers, cfg.batch_size, cfg.grad_accum)


def torch_numel(t: Any) -> int:
    import torch

    return torch.as_tensor(t).numel()


def describe_global_batch(cfg: TrainConfig, workers: int) -> str:
    total = workers * cfg.batch_size * cfg.grad_accum
    if cfg.grad_accum == 1:
        return str(total)
    return f"{total} ({workers} workers x {cfg.batch_size} x {cfg.grad_accum} accumulation steps)"


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
    data_decides_steps = cfg.data != "synthetic" or cfg.dataset is not None
    if not data_decides_steps and cfg.steps_per_epoch != saved.get("steps_per_epoch", cfg.steps_per_epoch):
        raise ConfigError(
            f"run {cfg.name} has steps_per_epoch={saved['steps_per_epoch']} in {dir_name}; "
            "resume with the same --steps-per-epoch, or use a new --name"
        )


@contextmanager
def attach_ray(address: Optional[str], verbose: bool, local_cpus: int = 0,
               show_worker_output: bool = False) -> Iterator[list[int]]:
    """Attach to Ray (``address``, RAY_ADDRESS, or an already initialized Ray) or start a
    private local one; yield the GPU count of each alive node; disconnect (or stop) only
    what this call connected (or started)."""
    if address is not None:
        _check_reachable(address)  # an explicit address is checked even if Ray is up here
    address = address or os.environ.get("RAY_ADDRESS")
    if address is None and "ray" not in sys.modules:
        # A private single-node Ray listens on loopback only, as Ray does on a laptop
        # (macOS); Ray reads this when it is imported, so only before that.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    started_here = False
    if not ray.is_initialized():
        kwargs: dict[str, Any] = dict(
            log_to_driver=verbose or show_worker_output,
            logging_level=logging.INFO if verbose else logging.ERROR,
        )
        if address is None:
            # as many CPU slots as workers asked for, so a local run never waits
            kwargs.update(num_cpus=max(os.cpu_count() or 1, local_cpus), include_dashboard=False)
            address = "local"
        else:
            _check_reachable(address)  # RAY_ADDRESS: fail in seconds, not minutes
        try:
            ray.init(address=address, **kwargs)
        except (ConnectionError, RuntimeError, ValueError) as err:
            if address == "local":
                raise
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(
                f"cannot attach to the Ray cluster at {address} ({first}); start one with "
                "`ray start --head`, fix --address / RAY_ADDRESS, or unset both to run locally"
            ) from None
        started_here = True
    try:
        yield [int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")]
    finally:
        if started_here:
            ray.shutdown()


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds, not minutes, on a cluster that is not there: ray.init retries a
    dead GCS address for a long time before it gives up."""
    import socket

    if address.startswith(("http://", "https://")):
        raise ConfigError(
            f"--address / RAY_ADDRESS is {address}, a dashboard (job server) address; "
            "ray-ddp attaches to the cluster's GCS address (HOST:6379) or 'auto'"
        )
    if address.startswith("ray://"):
        return  # Ray Client: its own connection handling
    gcs = address
    if address == "auto":
        from ray._private.services import canonicalize_bootstrap_address

        try:
            gcs = canonicalize_bootstrap_address("auto")
        except (ConnectionError, RuntimeError, ValueError):
            gcs = None
        if not gcs:
            raise ConfigError("--address auto found no running Ray cluster on this machine; "
                              "start one with `ray start --head` or drop --address")
    host, _, port = gcs.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError):
        raise ConfigError(
            f"no Ray cluster answers at {gcs}; start one with `ray start --head`, "
            "fix --address / RAY_ADDRESS, or unset both to run locally"
        ) from None


def _write_status(store: StorageConfig, run_path: str, state: str, cfg: TrainConfig,
                  placement: PlacementConfig, error: Optional[str] = None) -> None:
    """status.json: what `ray-ddp runs` shows. ``created`` survives resumes."""
    path = f"{run_path}/{STATUS_FILE}"
    store.fs.create_dir(run_path, recursive=True)
    old = read_json(store.fs, path) or {}
    now = time.time()
    write_json(store.fs, path, {
        "state": state, "created": old.get("created", now), "updated": now,
        "epochs": cfg.epochs, "world_size": placement.workers,
        "gpus_per_worker": placement.gpus_per_worker, "model": cfg.model, "error": error,
    })


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
            callbacks=[MetricsCallback(store.uri, cfg.name, cfg.epochs, cfg.steps_per_epoch,
                                       tensorboard=cfg.tensorboard)],
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
    """The one place that sets workers' environment: nothing, except that a user model or
    dataset (``package.module:callable``) must import on the workers as it did here."""
    specs = [spec for spec in (cfg.model, cfg.dataset) if spec and ":" in spec]
    return importable_env(*(spec.split(":")[0] for spec in specs)) if specs else {}


def importable_env(*module_names: str) -> dict[str, Any]:
    """A runtime_env that puts the folder ``module_name`` was imported from on workers'
    PYTHONPATH (Ray does not ship the driver's sys.path). Under ``ray job submit`` the
    job's working_dir is there already; on a multi-node cluster the folder must exist on
    every node, as a shared filesystem or the job's working_dir provides."""
    import importlib

    roots = []
    for module_name in module_names:
        top = module_name.split(".")[0]
        if top == "__main__":
            continue  # cloudpickle ships __main__'s functions by value
        origin = getattr(importlib.import_module(top), "__file__", None)
        if origin is None:
            continue
        root = os.path.dirname(os.path.abspath(origin))
        if os.path.basename(origin) == "__init__.py":
            root = os.path.dirname(root)  # a package: its parent folder goes on the path
        roots.append(root)
    if not roots:
        return {}
    paths = roots + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}}


def _process_start_time(fallback: float) -> float:
    """When this process started (the user's command), so start-up counts the imports."""
    try:  # Linux: the process's start in clock ticks after boot, and the boot time
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):  # not Linux: count from run()
        return fallback


def describe_startup(marks: dict[str, float], table) -> Optional[dict[str, float]]:
    """Where the seconds before the first training step went, in order:
    python (interpreter and imports), checks (config, model, data, storage), ray
    (ray.init or attaching), placement (resources, preflight), trainer (Ray Train's
    controller, the worker processes, the process group) and first_step (model build,
    checkpoint load, DDP's broadcast, the first step itself, on rank 0)."""
    # rank 0's first attempt in this run (a resumed run's table holds older runs' rows too)
    rows = [r for r in table.to_pylist() if r["rank"] == 0 and r.get("first_step_at") is not None
            and r["started_at"] >= marks["fit"]]
    if not rows:
        return None
    first = min(rows, key=lambda r: r["started_at"])
    points = [("python", marks["run"]), ("checks", marks["attach"]), ("ray", marks["ray"]),
              ("placement", marks["fit"]), ("trainer", first["started_at"]),
              ("first_step", first["first_step_at"])]
    out, previous = {}, marks["process"]
    for name, at in points:
        out[name] = round(at - previous, 3)
        previous = at
    out["total"] = round(first["first_step_at"] - marks["process"], 3)
    return out


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


def _write_summary(cfg: TrainConfig, store: StorageConfig, placement: Optional[PlacementConfig],
                   resumed_from: Optional[str], started: float,
                   marks: Optional[dict[str, float]] = None) -> RunSummary:
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
        startup_s=describe_startup(marks, table) if marks and table is not None else None,
    )
    write_json(store.fs, f"{run_path}/{SUMMARY_FILE}", summary.to_dict())
    return summary
