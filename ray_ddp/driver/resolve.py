"""resolve(cfg, data, placement) -> RunPlan: the one place a run's derived values are
made, from the user's checked config, what its data decides and (once Ray is attached)
where its workers go. Runs on the driver: before Ray starts for the checks (the workers
the flags name), again with the placement for the fit, and again for each restart of
an elastic run (its world size may change; its global batch never does).
"""

from __future__ import annotations

from typing import Optional

from ray_ddp.cluster.placement import Placement
from ray_ddp.config.train import TrainConfig
from ray_ddp.config.workers import worker_range
from ray_ddp.data.plan import DataShape, data_decides, global_batch_for
from ray_ddp.plan import BatchPlan, RunPlan
from ray_ddp.storage import Storage
from ray_ddp.record.folder import run_folder


def resolve(cfg: TrainConfig, data: Optional[DataShape], placement: Optional[Placement] = None,
            store: Optional[Storage] = None) -> RunPlan:
    """The RunPlan of ``cfg`` (checked, never changed here) for its ``data`` (None:
    synthetic), ``placement`` (None before Ray: the largest world the flags name, or 1)
    and its opened ``store`` (None before: no folder yet)."""
    workers = placement.workers if placement is not None else (worker_range(cfg.workers) or (1, 1))[1]
    batch = BatchPlan(global_batch_for(cfg, workers), cfg.batch_size)
    decided = data_decides(cfg, data, batch.global_batch)
    where = {} if placement is None else dict(
        workers=f"{placement.min_workers}-{placement.workers}" if placement.elastic else placement.workers,
        gpus_per_worker=placement.gpus_per_worker, cpus_per_worker=placement.cpus_per_worker,
        backend=placement.backend)
    folder = run_folder(store, cfg.name) if store is not None and cfg.name else None
    return RunPlan(config=cfg, batch=batch, folder=folder, **decided,
                   **(where or dict(workers=cfg.workers, gpus_per_worker=cfg.gpus_per_worker,
                                    cpus_per_worker=cfg.cpus_per_worker, backend=cfg.backend)))


def describe_global_batch(plan: RunPlan, placement: Placement) -> str:
    """The global batch, and how it is cut (for an elastic run: at its largest world size)."""
    batch, cut = plan.batch, plan.batch.cut(placement.workers)
    if placement.elastic:
        return (f"{batch.global_batch}, fixed whatever the world size (micro-batches of at most "
                f"{batch.batch_size}; {cut.grad_accum} accumulation step(s) per worker at {placement.workers} workers)")
    if cut.grad_accum == 1 and batch.global_batch == placement.workers * batch.batch_size:
        return str(batch.global_batch)
    return (f"{batch.global_batch} ({placement.workers} workers x {cut.grad_accum} accumulation steps of at most "
            f"{batch.batch_size})")
