"""run(cfg) -> RunSummary: everything ``ray-ddp train`` does, on the driver, as a short
list of verbs: check, inspect the data, open the storage, find where to start, attach to
Ray, place the workers, fit, summarize.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Callable, Optional
from ray_ddp.cluster.attach import FoundCluster, attach_ray, refresh_elastic_view
from ray_ddp.cluster.preflight import ensure_cluster_fits, ensure_cpu_for_ray_data
from ray_ddp.errors import ConfigError, TrainingError
from ray_ddp.config.checks import check_devices, check_objects
from ray_ddp.config.choices import SHARDED_STRATEGIES
from ray_ddp.config.train import TrainConfig
from ray_ddp.config.workers import worker_range
from ray_ddp.cluster.placement import Placement, plan_placement
from ray_ddp.data.checks import check_data_paths, check_train_data
from ray_ddp.data.plan import DataShape, check_row_targets, inspect_data
from ray_ddp.data.ray_data import is_ray_dataset, plan_ray_data
from ray_ddp.data.saved import open_saved_datasets
from ray_ddp.parallel.units import check_fsdp_wrap
from ray_ddp.models.build import check_init_from, check_model, model_stages
from ray_ddp.storage import Storage, check_writable, read_json, resolve_storage
from ray_ddp.record.events import from_records
from ray_ddp.driver.supervisor import fit_with_status
from ray_ddp.driver.snapshots import drop_snapshots
from ray_ddp.driver.resolve import describe_global_batch, resolve
from ray_ddp.plan import RunPlan
from ray_ddp.driver.start import StartState, find_start
from ray_ddp.record.status import read_events
from ray_ddp.driver.summary import RunSummary, write_summary
from ray_ddp.driver.tracking import check_tracking, close_run_tracking, open_run_tracking
from ray_ddp.record.folder import run_folder


def run(cfg: TrainConfig, echo: Callable[[str], None] = print, *, model: Any = None,
        train_data: Any = None, val_data: Any = None, loss: Optional[Callable] = None,
        collate: Optional[Callable] = None) -> RunSummary:
    """Train as ``cfg`` says and return the summary. Raises ConfigError on a user mistake
    (before anything is written) and TrainingError when training failed. ``cfg`` itself is
    left as it was: each step below returns a resolved copy.

    Objects instead of module paths: ``model`` an nn.Module or a callable returning one,
    ``train_data`` / ``val_data`` map-style Datasets of (input, target) pairs or dict rows
    (a ``datasets.Dataset``), ``loss`` fn(output, target) -> the batch's mean loss,
    ``collate`` fn(list of items) -> a batch (a ``transformers`` DataCollator too). Ray
    ships them to the workers pickled (cloudpickle), so they may be defined in a notebook
    or a script workers cannot import."""
    started = time.time()
    marks = {"process": _process_start_time(started), "run": started}  # start-up timeline
    cfg, train_data, val_data = open_saved_datasets(cfg, train_data, val_data)  # --data DIR of save_to_disk
    objects = {"model": model, "train_data": train_data, "val_data": val_data, "loss": loss, "collate": collate}
    cfg, data_shape, plan = check_run(cfg, objects)  # cfg: the user's intent, checked: never rewritten below
    store = open_storage(cfg)
    start, init_from = find_start_point(plan, store, data_shape, model, echo)
    if start.complete:
        return summary_of_complete_run(plan, store, start, started)

    marks["attach"] = time.time()
    workers = worker_range(cfg.workers)
    # A Ray started here prestarts idle Python workers for this driver, and Ray Train can
    # use none of them: its controller, helper actors and workers each carry a runtime_env
    # (environment variables), so each gets a process of its own. On a small machine the
    # idle ones only take CPU from Train's start (benchmarks/startup.py).
    ray_data = cfg.ray_data or any(is_ray_dataset(v) for v in (train_data, val_data))
    # a Ray started here holds the workers' CPUs, and one more for Ray Data's tasks where it reads
    with attach_ray(cfg.address, cfg.verbose, idle_workers=False,
                    local_cpus=(workers[1] if workers else 0) * (cfg.cpus_per_worker or 1) + ray_data) as cluster:
        marks["ray"] = time.time()
        plan, placement = place_workers(cfg, cluster, data_shape, store, echo)
        if ray_data:
            ensure_cpu_for_ray_data(placement)
        announce(plan, placement, start, store, echo)
        tracking = open_run_tracking(plan, start.run_id, store)
        ray_inputs = plan_ray_data(cfg, data_shape, train_data, val_data)  # Ray Datasets go to the trainer
        marks["fit"] = time.time()
        try:
            fit_with_status(plan, store, placement, start,
                            {k: None if is_ray_dataset(v) else v for k, v in objects.items()}, echo,
                            init_from=init_from,
                            model_loss=data_shape is not None and data_shape.hands_labels and loss is None,
                            tracking=tracking, ray_inputs=ray_inputs)
        except BaseException as err:
            close_run_tracking(tracking, store, cfg, None, read_events(run_folder(store, cfg.name)),
                               "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED", echo,
                               fit_over=isinstance(err, TrainingError))
            raise
        finally:
            if cfg.snapshot_every_steps != 0:  # the command's end, however it ends: they are memory
                drop_snapshots(cfg.storage, cfg.name)
        marks["fitted"] = time.time()  # the last step's report and checkpoint are done
    summary = write_summary(plan, store, placement, start.resumed_from, started, marks,
                            start.scan.meta)
    close_run_tracking(tracking, store, cfg, summary.to_dict(), from_records(summary.events), "FINISHED", echo)
    return summary


def summary_of_complete_run(plan: RunPlan, store: Storage, start: StartState, started: float) -> RunSummary:
    """The summary of a run with nothing left to train: its own summary.json, marked so."""
    summary = read_json(store.fs, run_folder(store, plan.config.name).summary)
    if summary is not None:
        return RunSummary(**{**summary, "already_complete": True})
    return write_summary(plan, store, None, start.resumed_from, started)


def check_run(cfg: TrainConfig, objects: dict[str, Any]) -> tuple[TrainConfig, Optional[DataShape], RunPlan]:
    """Everything checked before Ray starts (bad data costs seconds, not a cluster): the
    config, the data's shape, the run resolved for the workers the flags name (resolved
    again for the workers the cluster gives), the model against a row, the MLflow server.
    Returns the checked config, the data's shape and that first RunPlan."""
    cfg = check_config(cfg, objects)
    loss = objects.get("loss")
    data_shape = inspect_data(cfg, objects.get("train_data"), objects.get("val_data"), objects.get("collate"))
    check_row_targets(data_shape, loss is not None or cfg.loss is not None)
    plan = resolve(cfg, data_shape)
    check_model(plan, objects.get("model"),
                data_shape.example if data_shape is not None and loss is None else None,
                more_checks=[functools.partial(check_fsdp_wrap, cfg)] if cfg.strategy in SHARDED_STRATEGIES else [])
    check_tracking(cfg)  # an unreachable MLflow server: one line before Ray starts
    return cfg, data_shape, plan


def find_start_point(plan: RunPlan, store: Storage, data_shape: Optional[DataShape], model: Any,
                     echo: Callable[[str], None]) -> tuple[StartState, Optional[str]]:
    """Where the run starts (a new run, or the checkpoint to resume; find_start), and the
    --init-from weights a new run starts from (checked against the model's keys before
    any worker reads them; a resume ignores the flag, and says so)."""
    cfg = plan.config
    start = find_start(plan, store, data_shape, echo)
    init_from = cfg.init_from if start.resumed_from is None else None
    if cfg.init_from and init_from is None:
        echo(f"--init-from {cfg.init_from} is ignored: run {cfg.name} resumes from its own "
             f"checkpoint {start.resumed_from}")
    elif init_from is not None:
        check_init_from(plan, model, init_from)
    return start, init_from


def check_config(cfg: TrainConfig, objects: dict[str, Any]) -> TrainConfig:
    """The validated config with the run's name and the Python API's objects named in it
    (``python:<Name>``: what status.json, the resume check and the start line show; the
    objects themselves go to the workers in the WorkerPlan)."""
    cfg = cfg.validate()  # a checked copy: the caller's config stays as given
    check_objects(cfg, objects)
    check_train_data(cfg, objects.get("train_data"))
    check_data_paths(cfg)
    model = objects.get("model")
    if model is not None:
        from torch import nn

        name = type(model).__name__ if isinstance(model, nn.Module) else getattr(model, "__name__", "model")
        cfg = dataclasses.replace(cfg, model=f"python:{name}")
    if cfg.name is None:
        cfg = dataclasses.replace(cfg, name=time.strftime("ray_ddp-%Y%m%d-%H%M%S"))
    return cfg


def open_storage(cfg: TrainConfig) -> Storage:
    """The run storage, checked writable (and local, for TensorBoard's event files)."""
    store = resolve_storage(cfg.storage)
    check_writable(store)
    if cfg.tensorboard and not store.is_local:
        raise ConfigError(f"--tensorboard writes event files to a local disk; --storage {cfg.storage} "
                          "is not one (use a local or shared path, or drop --tensorboard)")
    return store


def place_workers(cfg: TrainConfig, cluster: FoundCluster, data_shape, store: Storage,
                  echo: Callable[[str], None]) -> tuple[RunPlan, Placement]:
    """Plan the placement on this cluster, check the cluster can ever hold it (waiting for
    an autoscaler if it must), and resolve the run for it: workers, devices, backend, the
    global batch and the steps per epoch."""
    workers = worker_range(cfg.workers)
    placement = plan_placement(workers[1] if workers else None, cfg.gpus_per_worker, cfg.backend,
                               cluster.node_gpus, stages=model_stages(cfg.model),
                               cpus_per_worker=cfg.cpus_per_worker, local_cpus=cluster.own_cpus,
                               min_workers=workers[0] if workers else None)
    check_devices(cfg, placement.use_gpu)
    ensure_cluster_fits(placement, cfg.wait_for_resources, echo)
    if placement.elastic:
        refresh_elastic_view()  # start with every worker the cluster holds now
    return resolve(cfg, data_shape, placement, store), placement


def announce(plan: RunPlan, placement: Placement, start: StartState, store: Storage,
             echo: Callable[[str], None]) -> None:
    cfg = plan.config
    if not cfg.quiet:
        where = f"resuming from {start.resumed_from}" if start.resumed_from else "new run"
        echo(f"ray_ddp: run {cfg.name} ({where}): {placement.describe()}, model {cfg.model}, "
             f"global batch {describe_global_batch(plan, placement)}, {cfg.epochs} "
             f"epochs x {plan.steps_per_epoch} steps"
             f"{f' (to step {cfg.max_steps} at most)' if cfg.max_steps else ''} -> {store.run_path(cfg.name)}")


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
