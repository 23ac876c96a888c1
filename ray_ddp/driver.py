"""run(cfg) -> RunSummary: everything ``ray-ddp train`` does, on the driver.

In order: validate the config and the model (before Ray starts, so a mistake costs
seconds), resolve the storage and the run's folder, stop at once if the run is already
complete, attach to Ray (or start a local one), plan the placement and check that the
cluster can ever hold it, run TorchTrainer.fit() while printing progress, and write
``summary.json`` from the metrics table the controller left in the run folder.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

from .checkpoint import CheckpointScan, find_latest_checkpoint
from .cluster import ClusterConfig, attach_ray, ensure_cluster_fits, refresh_elastic_view
from .config import ConfigError, TrainConfig, worker_range
from .devices import PlacementConfig, plan_placement
from .failures import FailureSummary, RestartState, describe_loss, summarize_failure
from .dataplan import fit_batch_to, fit_data_to, inspect_data
from .models import check_model, load_callable, model_stages
from .worker_env import train_controller_env, worker_runtime_env
from .progress import show_progress
from .storage import (EVAL_FILE, METRICS_FILE, PROGRESS_FILE, STATUS_FILE, SUMMARY_FILE, StorageConfig, check_writable,
                      read_json, read_table, resolve_storage, write_json)

# Fields of the checkpoint's config that must match for a resume to load the weights.
_SHAPE_KEYS = ("model", "task", "input_dim", "output_dim", "width", "depth", "heads", "seq_len",
               "vocab_size", "strategy")


class TrainingError(RuntimeError):
    """Training started but failed; the message names the failing rank and cause.
    ``failure``: the rank that explains it (None when Ray's controller failed), and
    ``step``: the last step the run reported."""

    def __init__(self, message: str, failure: Optional[FailureSummary] = None, step: Optional[int] = None):
        super().__init__(message)
        self.failure, self.step = failure, step


@dataclass
class RunSummary:
    """What a run left behind; ``--json`` prints it, ``summary.json`` stores it."""

    run: str
    path: str
    world_size: int
    gpus_per_worker: int
    epochs_completed: int
    final_loss: Optional[float]
    samples_per_s: Optional[float]  # steady state, over training windows (metrics rows)
    checkpoint: Optional[str]
    metrics: Optional[str]
    resumed_from: Optional[str]
    epochs: int = 0
    steps: int = 0
    backend: str = ""
    wall_time_s: float = 0.0
    already_complete: bool = False
    startup_s: Optional[dict[str, float]] = None
    # every sample of this run over the wall time from its first step to its last
    wall_samples_per_s: Optional[float] = None
    task: str = "regression"
    val_loss: Optional[float] = None  # the last validation's
    best_val_loss: Optional[float] = None
    val_accuracy: Optional[float] = None  # classification
    val_perplexity: Optional[float] = None  # lm
    best_checkpoint: Optional[str] = None  # with --keep-best: the lowest validation loss's
    # the world size of every stretch of the run: [{"world_size", "from_step", "to_step"}]
    world_sizes: Optional[list[dict[str, int]]] = None
    # checkpoints saved on a node's preemption notice: [{"node_id", "step", "checkpoint", ...}]
    preemptions: Optional[list[dict[str, Any]]] = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run(cfg: TrainConfig, echo: Callable[[str], None] = print, *, model: Any = None,
        train_data: Any = None, val_data: Any = None, loss: Optional[Callable] = None) -> RunSummary:
    """Train as ``cfg`` says and return the summary. Raises ConfigError on a user mistake
    (before anything is written) and TrainingError when training failed. ``cfg`` itself is
    left as it was: each step below returns a resolved copy.

    Objects instead of module paths: ``model`` an nn.Module or a callable returning one,
    ``train_data`` / ``val_data`` map-style Datasets of (input, target) pairs, ``loss``
    fn(output, target) -> the batch's mean loss. Ray ships them to the workers pickled
    (cloudpickle), so they may be defined in a notebook or a script workers cannot import."""
    started = time.time()
    marks = {"process": _process_start_time(started), "run": started}  # start-up timeline
    objects = {"model": model, "train_data": train_data, "val_data": val_data, "loss": loss}
    cfg = check_config(cfg, objects)
    data_shape = inspect_data(cfg, train_data, val_data)  # before Ray starts: bad data costs seconds
    given_batch = cfg.global_batch  # None: workers x batch x accum, once the workers are known
    cfg = fit_data_to(fit_batch_to(cfg, (worker_range(cfg.workers) or (1, 1))[1], given_batch),
                      data_shape)  # redone below for the world size the cluster gives
    check_model(cfg, model, data_shape.example if data_shape is not None and loss is None else None)
    store = open_storage(cfg)
    start = find_start(cfg, store, data_shape, echo)
    if start.complete:
        summary = read_json(store.fs, f"{store.run_path(cfg.name)}/{SUMMARY_FILE}")
        if summary is not None:
            return RunSummary(**{**summary, "already_complete": True})
        return _write_summary(cfg, store, None, start.resumed_from, started)

    marks["attach"] = time.time()
    workers = worker_range(cfg.workers)
    # A Ray started here prestarts idle Python workers for this driver, and Ray Train can
    # use none of them: its controller, helper actors and workers each carry a runtime_env
    # (environment variables), so each gets a process of its own. On a small machine the
    # idle ones only take CPU from Train's start (benchmarks/startup.py).
    with attach_ray(cfg.address, cfg.verbose, idle_workers=False,
                    local_cpus=(workers[1] if workers else 0) * (cfg.cpus_per_worker or 1)) as cluster:
        marks["ray"] = time.time()
        cfg, placement = place_workers(cfg, cluster, data_shape, given_batch, echo)
        announce(cfg, placement, start, store, echo)
        marks["fit"] = time.time()
        _fit_with_status(cfg, store, placement, start, objects, echo)
    return _write_summary(cfg, store, placement, start.resumed_from, started, marks, start.scan.meta)


@dataclass(frozen=True)
class StartState:
    """Where a run starts: the checkpoint scan, the resumed folder's URI (None for a new
    run), and whether the run is already complete."""

    scan: CheckpointScan
    resumed_from: Optional[str]
    complete: bool


def check_config(cfg: TrainConfig, objects: dict[str, Any]) -> TrainConfig:
    """The validated config with the run's name, the Python API's objects named in it, and
    the user's loss and collate functions imported (workers import them too: fail here)."""
    cfg = _with_objects(dataclasses.replace(cfg), objects["model"], objects["train_data"],
                        objects["loss"]).validate()
    if cfg.name is None:
        cfg = dataclasses.replace(cfg, name=time.strftime("ray_ddp-%Y%m%d-%H%M%S"))
    if cfg.keep_best and not (cfg.val_data or cfg.val_fraction or objects["val_data"] is not None):
        raise ConfigError("--keep-best keeps the checkpoint with the lowest validation loss: "
                          "give --val-data, --val-fraction or val_data=")
    for spec, what in ((cfg.loss, "loss"), (cfg.collate, "collate")):
        if spec is not None:
            load_callable(spec, what=what)
    return cfg


def open_storage(cfg: TrainConfig) -> StorageConfig:
    """The run storage, checked writable (and local, for TensorBoard's event files)."""
    store = resolve_storage(cfg.storage)
    check_writable(store)
    if cfg.tensorboard and not store.is_local:
        raise ConfigError(f"--tensorboard writes event files to a local disk; --storage {cfg.storage} "
                          "is not one (use a local or shared path, or drop --tensorboard)")
    return store


def find_start(cfg: TrainConfig, store: StorageConfig, data_shape, echo: Callable[[str], None]) -> StartState:
    """The newest whole checkpoint of the run (every file checked), whether this command
    can resume from it, and whether there is anything left to train."""
    scan = find_latest_checkpoint(store.fs, store.run_path(cfg.name), verify_crc=True)
    _say_broken(cfg, scan, echo)
    resumed_from = f"{_join(store.uri, cfg.name)}/{scan.latest}" if scan.latest else None
    complete = False
    if scan.meta is not None:
        _check_resumable(cfg, scan.meta, scan.latest,
                         data_decides_steps=data_shape is not None and data_shape.rows > 0)
        if scan.meta["epoch"] >= cfg.epochs:
            echo(f"run {cfg.name} is already complete ({scan.meta['epoch']}/{cfg.epochs} epochs); "
                 "nothing to do (raise --epochs to train further)")
            complete = True
    return StartState(scan, resumed_from, complete)


def place_workers(cfg: TrainConfig, cluster: ClusterConfig, data_shape, given_batch: Optional[int],
                  echo: Callable[[str], None]) -> tuple[TrainConfig, PlacementConfig]:
    """Plan the placement on this cluster, check the cluster can ever hold it (waiting for
    an autoscaler if it must), and return the config resolved for it: workers, devices,
    backend, the global batch and the steps per epoch."""
    workers = worker_range(cfg.workers)
    placement = plan_placement(workers[1] if workers else None, cfg.gpus_per_worker, cfg.backend,
                               cluster.node_gpus, stages=model_stages(cfg.model),
                               cpus_per_worker=cfg.cpus_per_worker, local_cpus=cluster.own_cpus,
                               min_workers=workers[0] if workers else None)
    if cfg.amp == "fp16" and not placement.use_gpu:
        raise ConfigError("--amp fp16 needs GPUs and this run is on CPU; use --amp bf16")
    if cfg.sync_batchnorm and not placement.use_gpu:
        raise ConfigError("--sync-batchnorm needs GPUs (PyTorch's SyncBatchNorm runs on CUDA "
                          "only); drop it on CPU")
    ensure_cluster_fits(placement, cfg.wait_for_resources, echo)
    if placement.elastic:
        refresh_elastic_view()  # start with every worker the cluster holds now
    cfg = fit_data_to(fit_batch_to(cfg, placement.workers, given_batch), data_shape)
    cfg = dataclasses.replace(cfg, workers=f"{placement.min_workers}-{placement.workers}"
                              if placement.elastic else placement.workers,
                              gpus_per_worker=placement.gpus_per_worker,
                              cpus_per_worker=placement.cpus_per_worker, backend=placement.backend)
    return cfg, placement


def announce(cfg: TrainConfig, placement: PlacementConfig, start: StartState, store: StorageConfig,
             echo: Callable[[str], None]) -> None:
    if not cfg.quiet:
        where = f"resuming from {start.resumed_from}" if start.resumed_from else "new run"
        echo(f"ray_ddp: run {cfg.name} ({where}): {placement.describe()}, model {cfg.model}, "
             f"global batch {describe_global_batch(cfg, placement)}, {cfg.epochs} "
             f"epochs x {cfg.steps_per_epoch} steps -> {store.run_path(cfg.name)}")


def _fit_with_status(cfg: TrainConfig, store: StorageConfig, placement: PlacementConfig,
                     start: StartState, objects: dict[str, Any], echo: Callable[[str], None]) -> None:
    """TorchTrainer.fit() with progress shown, and status.json telling where it stands;
    started again from the newest checkpoint when ``failures`` says the run goes on."""
    run_path = store.run_path(cfg.name)
    scan = start.scan
    restarts = RestartState()
    _write_status(store, run_path, "running", cfg, placement)
    try:
        while True:
            try:
                with show_progress(store, run_path, echo, enabled=not cfg.quiet), train_controller_env():
                    _fit(cfg, store, placement, _loop_config(cfg, scan, objects), objects)
                break
            except TrainingError as err:
                scan = find_latest_checkpoint(store.fs, run_path, verify_crc=True)
                why = _decide_restart(err, restarts, cfg, placement, store, scan)
                if why is None:
                    raise
                echo(f"{err}; restarting from {scan.latest or 'the start'} ({why})"
                     + _steps_to_redo(err.step, scan.meta))
    except TrainingError as err:
        _write_status(store, run_path, "failed", cfg, placement, error=str(err))
        raise
    except KeyboardInterrupt:
        _write_status(store, run_path, "interrupted", cfg, placement)
        raise
    except BaseException as err:  # a bug or a storage failure: never leave "running"
        _write_status(store, run_path, "failed", cfg, placement, error=f"{type(err).__name__}: {err}")
        raise
    from .metrics import world_stretches  # imports Ray

    table = read_table(store.fs, f"{run_path}/{METRICS_FILE}")
    _write_status(store, run_path, "complete", cfg, placement,
                  stretches=world_stretches(table) if table is not None and table.num_rows else None)


def _loop_config(cfg: TrainConfig, scan: CheckpointScan, objects: dict[str, Any]) -> dict[str, Any]:
    from ray import cloudpickle

    return {"config": cfg.to_dict(), "resume_from": scan.latest, "newest_at_start": scan.newest,
            "total_steps": planned_steps(cfg, scan.meta),
            # pickled here: Ray Train's controller only hands them on, and could not import
            # a user's module that only the workers' PYTHONPATH holds
            "objects": cloudpickle.dumps({k: v for k, v in objects.items() if v is not None})}


def _decide_restart(err: "TrainingError", restarts: RestartState, cfg: TrainConfig,
                    placement: PlacementConfig, store: StorageConfig, scan: CheckpointScan) -> Optional[str]:
    """Why the driver starts the run again, or None; a run that stops gets the end of its
    one line (what would have let it go on) added to ``err``."""
    if err.failure is None:
        return None
    progress = read_json(store.fs, f"{store.run_path(cfg.name)}/{PROGRESS_FILE}") or {}
    preempted = {n for p in progress.get("preemptions") or [] for n in str(p.get("node_id", "")).split(",") if n}
    run_nodes = {str(n) for n in (progress.get("nodes") or {}).values() if n}
    why = restarts.decide(err.failure, placement.elastic, cfg.max_failures, cfg.max_preemptions,
                          preempted, run_nodes, scan.latest)
    if why is None:
        err.args = (str(err) + restarts.why_stopped(err.failure, placement.elastic, cfg.max_failures),)
    return why


def _steps_to_redo(step: Optional[int], meta: Optional[dict[str, Any]]) -> str:
    if step is None:
        return ""
    redo = step - (meta["step"] if meta else 0)
    return f": {redo} step{'s' if redo != 1 else ''} to redo" if redo > 0 else ""


def planned_steps(cfg: TrainConfig, meta: Optional[dict[str, Any]]) -> int:
    """The global step the run ends at: the steps a resumed run already took, plus what
    is left at this run's steps per epoch (another world size or batch may give other
    steps per epoch than the checkpoint's run had)."""
    if meta is None:
        return cfg.epochs * cfg.steps_per_epoch
    return meta["step"] - meta.get("epoch_step", 0) + (cfg.epochs - meta["epoch"]) * cfg.steps_per_epoch


def _with_objects(cfg: TrainConfig, model: Any, train_data: Any, loss: Any) -> TrainConfig:
    """Name what the Python API passed in the config (what status.json, the resume check
    and the start line show): ``python:<ClassName>``; the objects themselves go to the
    workers apart from the config."""
    import torch

    changes = {}
    if model is not None:
        if not (isinstance(model, torch.nn.Module) or callable(model)):
            raise ConfigError(f"model= must be an nn.Module or a callable returning one, not "
                              f"{type(model).__name__}")
        name = type(model).__name__ if isinstance(model, torch.nn.Module) else getattr(model, "__name__", "model")
        changes["model"] = f"python:{name}"
    if train_data is not None and (cfg.data != "synthetic" or cfg.dataset is not None):
        raise ConfigError("give train_data= or --data / --dataset, not both")
    if cfg.collate is not None and cfg.dataset is None and train_data is None:
        raise ConfigError("--collate is for --dataset or train_data= (parquet and text rows are "
                          "batched by ray-ddp)")
    if loss is not None and not callable(loss):
        raise ConfigError(f"loss= must be a callable fn(output, target), not {type(loss).__name__}")
    return dataclasses.replace(cfg, **changes)


def describe_global_batch(cfg: TrainConfig, placement: PlacementConfig) -> str:
    """The global batch, and how it is cut (for an elastic run: at its largest world size)."""
    from .data import accumulation_for

    accum = accumulation_for(cfg.global_batch, placement.workers, cfg.batch_size)
    if placement.elastic:
        return (f"{cfg.global_batch}, fixed whatever the world size (micro-batches of at most "
                f"{cfg.batch_size}; {accum} accumulation step(s) per worker at {placement.workers} workers)")
    if accum == 1 and cfg.global_batch == placement.workers * cfg.batch_size:
        return str(cfg.global_batch)
    return (f"{cfg.global_batch} ({placement.workers} workers x {accum} accumulation steps of at most "
            f"{cfg.batch_size})")


def _join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}"


def _check_resumable(cfg: TrainConfig, meta: dict[str, Any], dir_name: str, data_decides_steps: bool) -> None:
    saved = meta.get("config", {})
    for key in _SHAPE_KEYS:
        if key in saved and saved[key] != getattr(cfg, key):
            raise ConfigError(
                f"run {cfg.name} was trained with {key}={saved[key]!r} but this command has "
                f"{key}={getattr(cfg, key)!r}; use the same value to resume, or a new --name"
            )
    if not data_decides_steps and cfg.steps_per_epoch != saved.get("steps_per_epoch", cfg.steps_per_epoch):
        raise ConfigError(
            f"run {cfg.name} has steps_per_epoch={saved['steps_per_epoch']} in {dir_name}; "
            "resume with the same --steps-per-epoch, or use a new --name"
        )


def _write_status(store: StorageConfig, run_path: str, state: str, cfg: TrainConfig,
                  placement: PlacementConfig, error: Optional[str] = None,
                  stretches: Optional[list[dict[str, int]]] = None) -> None:
    """status.json: what `ray-ddp runs` shows. ``created`` survives resumes, and so do
    the world-size stretches until a finished run gives new ones. Reads nothing else, so
    a failure path can always write it."""
    path = f"{run_path}/{STATUS_FILE}"
    store.fs.create_dir(run_path, recursive=True)
    try:
        old = read_json(store.fs, path) or {}
    except ValueError:  # not JSON: start the record afresh
        old = {}
    now = time.time()
    stretches = old.get("world_sizes", []) if stretches is None else stretches
    write_json(store.fs, path, {
        "state": state, "created": old.get("created", now), "updated": now,
        "epochs": cfg.epochs, "world_size": stretches[-1]["world_size"] if stretches else placement.workers,
        "workers": cfg.workers, "world_sizes": stretches,
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
         loop_config: dict[str, Any], objects: dict[str, Any]) -> None:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchConfig, TorchTrainer

    from .loop import train_loop_per_worker
    from .metrics import MetricsCallback

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend=placement.backend),
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
            callbacks=[MetricsCallback(store.uri, cfg.name, cfg.epochs, loop_config["total_steps"],
                                       tensorboard=cfg.tensorboard, keep=cfg.keep, keep_best=cfg.keep_best)],
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


_RUNS_IN_THIS_PROCESS = 0


def _process_start_time(fallback: float) -> float:
    """When this process started (the user's command), so start-up counts the imports;
    for a second run() in the same process (a notebook, a script that trains twice) the
    run's own start: its interpreter and imports were paid before."""
    global _RUNS_IN_THIS_PROCESS
    _RUNS_IN_THIS_PROCESS += 1
    if _RUNS_IN_THIS_PROCESS > 1:
        return fallback
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


def _training_error(err: Exception, run_path: str, store: StorageConfig) -> TrainingError:
    """One line for the user: the rank that explains the failure (a dead worker or node
    before the survivors' broken connections) and its cause."""
    progress = read_json(store.fs, f"{run_path}/{PROGRESS_FILE}") or {}
    failures = getattr(err, "worker_failures", None) or {}
    if not failures:
        text = str(err).strip().splitlines()
        return TrainingError("training failed: " + (text[-1] if text else type(err).__name__))
    failure = summarize_failure(failures, progress.get("nodes") or {})
    step = progress.get("step")
    if failure.lost is None:
        return TrainingError(f"training failed on rank {failure.rank}: {failure.cause}", failure, step)
    return TrainingError(describe_loss(failure, step), failure, step)


def summarize_evals(evals: list[dict[str, Any]], run_path: str, fs, run_uri: Optional[str]) -> dict[str, Any]:
    """summary.json's validation fields from eval.parquet's rows; ``run_uri`` given (with
    --keep-best): also the kept checkpoint whose validation loss was the lowest."""
    if not evals:
        return {}
    last = evals[-1]
    out = {"val_loss": last["loss"], "best_val_loss": min(r["loss"] for r in evals),
           "val_accuracy": last.get("accuracy"), "val_perplexity": last.get("perplexity")}
    if run_uri is not None:
        from pyarrow.fs import FileSelector, FileType

        from .metrics import best_checkpoint

        names = [i.base_name for i in fs.get_file_info(FileSelector(run_path))
                 if i.type == FileType.Directory and i.base_name.startswith("step-")]
        best = best_checkpoint(names, evals)
        out["best_checkpoint"] = f"{run_uri}/{best}" if best else None
    return out


def _write_summary(cfg: TrainConfig, store: StorageConfig, placement: Optional[PlacementConfig],
                   resumed_from: Optional[str], started: float,
                   marks: Optional[dict[str, float]] = None,
                   resumed_meta: Optional[dict[str, Any]] = None) -> RunSummary:
    from .metrics import preemption_checkpoints, summarize_metrics, world_stretches  # imports Ray

    run_path = store.run_path(cfg.name)
    run_uri = _join(store.uri, cfg.name)
    scan = find_latest_checkpoint(store.fs, run_path)
    meta = scan.meta or {}
    saved_cfg = meta.get("config", {})
    table = read_table(store.fs, f"{run_path}/{METRICS_FILE}")
    evals = read_table(store.fs, f"{run_path}/{EVAL_FILE}")
    validation = summarize_evals(evals.to_pylist() if evals is not None else [], run_path, store.fs,
                                 run_uri if cfg.keep_best else None)
    resumed_step = int(resumed_meta["step"]) if resumed_meta else 0
    has_rows = table is not None and table.num_rows > 0
    stats = summarize_metrics(table, resumed_step) if has_rows else {}
    stretches = world_stretches(table) if has_rows else []
    summary = RunSummary(
        run=cfg.name,
        path=run_uri,
        # the world size the run ended on (an elastic run's stretches: world_sizes)
        world_size=stretches[-1]["world_size"] if stretches else
        (placement.workers if placement else meta.get("world_size", 0)),
        world_sizes=stretches,
        preemptions=preemption_checkpoints(table) if has_rows else [],
        gpus_per_worker=placement.gpus_per_worker if placement else saved_cfg.get("gpus_per_worker", 0),
        epochs_completed=meta.get("epoch", 0),
        final_loss=stats.get("final_loss"),
        samples_per_s=stats.get("samples_per_s"),
        wall_samples_per_s=stats.get("wall_samples_per_s"),
        checkpoint=f"{run_uri}/{scan.latest}" if scan.latest else None,
        metrics=f"{run_uri}/{METRICS_FILE}" if table is not None else None,
        resumed_from=resumed_from,
        epochs=cfg.epochs,
        steps=meta.get("step", 0),
        backend=placement.backend if placement else saved_cfg.get("backend", ""),
        wall_time_s=round(time.time() - started, 3),
        startup_s=describe_startup(marks, table) if marks and table is not None else None,
        task=cfg.task or "regression",
        **validation,
    )
    write_json(store.fs, f"{run_path}/{SUMMARY_FILE}", summary.to_dict())
    return summary
