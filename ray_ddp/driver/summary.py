"""summary.json: what a run left behind, from the metrics table the controller wrote.
Runs on the driver.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional
from ray_ddp.checkpoint.verify import find_latest_checkpoint
from ray_ddp.cluster.placement import Placement
from ray_ddp.record.folder import METRICS_FILE, PROFILE_FOLDER, RunFolder, run_folder
from ray_ddp.storage import Storage, read_table, write_json
from ray_ddp.record.metrics_table import read_metrics
from ray_ddp.plan import RunPlan, saved_run_config
from ray_ddp.record.status import read_events
from ray_ddp.checkpoint.retention import best_checkpoint, checkpoint_names
from ray_ddp.observe.summarize import early_stop_row, preemption_checkpoints, summarize_metrics, world_stretches


@dataclass
class RunSummary:
    """What a run left behind; ``--json`` prints it, ``summary.json`` stores it."""

    run: str
    path: str
    world_size: int
    gpus_per_worker: int
    epochs_completed: int
    final_loss: Optional[float]
    samples_per_s: Optional[float]  # the steady rate of training steps (reports, checkpoints left out)
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
    wall_samples_per_s: Optional[float] = None  # over the command's wall time, start-up included
    train_samples_per_s: Optional[float] = None  # from the first step to the last, everything included
    task: str = "regression"
    val_loss: Optional[float] = None  # the last validation's
    best_val_loss: Optional[float] = None
    val_accuracy: Optional[float] = None  # classification
    val_perplexity: Optional[float] = None  # lm
    best_checkpoint: Optional[str] = None  # with --keep-best: the lowest validation loss's
    # the world size of every stretch of the run: [{"world_size", "from_step", "to_step"}]
    world_sizes: Optional[list[dict[str, int]]] = None
    # every lost worker, preemption and resize: [{"type", "time", "step", "rank", "node",
    # "cause", "from_checkpoint", "steps_lost"}] (record/events.py)
    events: Optional[list[dict[str, Any]]] = None
    # checkpoints saved on a node's preemption notice: [{"node_id", "step", "checkpoint", ...}]
    preemptions: Optional[list[dict[str, Any]]] = None
    # --early-stop ended the run (its latest checkpoint), after epoch early_stop_epoch
    early_stopped: bool = False
    early_stop_epoch: Optional[int] = None
    profile: Optional[str] = None  # --profile: the folder of its traces (rank-<r>.pt.trace.json)
    # the figures the field reads (observe/summarize.py summarize_metrics says how each is taken)
    tokens_per_s: Optional[float] = None  # token tasks: input tokens per second, steady rate
    data_wait_s: Optional[float] = None  # seconds a step waited for its input, on average
    data_wait_share: Optional[float] = None  # that wait's share of the steps' time
    grad_norm: Optional[float] = None  # the last window's gradient norm before clipping
    mfu: Optional[float] = None  # model FLOPs utilisation (GPU, token tasks; worker/flops.py)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def summarize_evals(evals: list[dict[str, Any]], folder: RunFolder,
                    uri_of: Optional[Callable[[str], str]]) -> dict[str, Any]:
    """summary.json's validation fields from eval.parquet's rows; ``uri_of`` (a
    checkpoint's name -> its URI) given (with --keep-best): also the kept checkpoint whose
    validation loss was the lowest."""
    if not evals:
        return {}
    last = evals[-1]
    out = {"val_loss": last["loss"], "best_val_loss": min(r["loss"] for r in evals),
           "val_accuracy": last.get("accuracy"), "val_perplexity": last.get("perplexity")}
    if uri_of is not None:
        best = best_checkpoint(checkpoint_names(folder), evals)
        out["best_checkpoint"] = uri_of(best) if best else None
    return out


def profile_folder(store: Storage, name: str) -> Optional[str]:
    """Where --profile's traces are, if any were written."""
    from pyarrow.fs import FileSelector

    found = store.fs.get_file_info(FileSelector(run_folder(store, name).profile, allow_not_found=True))
    return store.uri_of(name, PROFILE_FOLDER) if any(i.base_name.endswith(".pt.trace.json") for i in found) else None


def write_summary(run: RunPlan, store: Storage, placement: Optional[Placement],
                   resumed_from: Optional[str], started: float,
                   marks: Optional[dict[str, float]] = None,
                   resumed_meta: Optional[dict[str, Any]] = None) -> RunSummary:
    cfg = run.config
    folder = run_folder(store, cfg.name)
    scan = find_latest_checkpoint(folder)
    meta = scan.meta or {}
    saved_cfg = saved_run_config(meta)
    table = read_metrics(folder)
    evals = read_table(store.fs, folder.evals)
    validation = summarize_evals(evals.to_pylist() if evals is not None else [], folder,
                                 (lambda best: store.uri_of(cfg.name, best)) if cfg.keep_best else None)
    resumed_step = int(resumed_meta["step"]) if resumed_meta else 0
    has_rows = table is not None and table.num_rows > 0
    stats = summarize_metrics(table, resumed_step, trained_until=(marks or {}).get("fitted"),
                              command_started=(marks or {}).get("process")) if has_rows else {}
    stretches = world_stretches(table) if has_rows else []
    stopped = early_stop_row(table, meta["step"]) if has_rows and scan.latest else None
    summary = RunSummary(
        run=cfg.name,
        path=store.uri_of(cfg.name),
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
        train_samples_per_s=stats.get("train_samples_per_s"),
        **{k: stats.get(k) for k in ("tokens_per_s", "data_wait_s", "data_wait_share", "grad_norm", "mfu")},
        events=[e.to_dict() for e in read_events(folder)],
        checkpoint=store.uri_of(cfg.name, scan.latest) if scan.latest else None,
        metrics=store.uri_of(cfg.name, METRICS_FILE) if table is not None else None,
        resumed_from=resumed_from,
        epochs=cfg.epochs,
        steps=meta.get("step", 0),
        backend=placement.backend if placement else saved_cfg.get("backend", ""),
        wall_time_s=round(time.time() - started, 3),
        startup_s=describe_startup(marks, table) if marks and table is not None else None,
        task=run.task,
        early_stopped=stopped is not None,
        early_stop_epoch=int(stopped["epoch"]) if stopped else None,
        profile=profile_folder(store, cfg.name),
        **validation,
    )
    write_json(store.fs, folder.summary, summary.to_dict())
    return summary
