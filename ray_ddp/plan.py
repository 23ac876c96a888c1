"""The run as resolved, typed: ``RunPlan`` (what the user asked for, and what the data
and the cluster decided), its ``BatchPlan`` (the global batch and how a world size cuts
it), and ``WorkerPlan``, all that crosses from the driver to a worker. Made on the
driver (driver/resolve.py makes the RunPlan, and nothing else derives), read on every
worker (Ray pickles the WorkerPlan into the trainer's train_loop_config).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from ray_ddp.config.train import TrainConfig
from ray_ddp.record.folder import RunFolder


@dataclass(frozen=True)
class BatchCut:
    """One world size's cut of the global batch: each rank's ``grad_accum`` micro-batches
    of at most ``micro_rows`` rows (the last step of an epoch may hold fewer)."""

    world: int
    global_batch: int
    grad_accum: int

    @property
    def micro_rows(self) -> int:
        return -(-self.global_batch // (self.world * self.grad_accum))


@dataclass(frozen=True)
class BatchPlan:
    """The run's global batch, fixed whatever the world size, and the most rows a
    micro-batch may hold (--batch-size: what fits in a worker's memory)."""

    global_batch: int
    batch_size: int

    def cut(self, world: int) -> BatchCut:
        """The accumulation steps at ``world`` ranks: as few as keep every micro-batch
        within --batch-size (an elastic run cuts again at each world size it gets)."""
        return BatchCut(world, self.global_batch, max(1, -(-self.global_batch // (world * self.batch_size))))


# What a RunPlan decides over the user's config, by TrainConfig field: read off the plan,
# never off a config; checkpoints store them apart (``plan``).
PLANNED_FIELDS = ("task", "input_dim", "output_dim", "num_classes", "global_batch", "steps_per_epoch",
                  "workers", "gpus_per_worker", "cpus_per_worker", "backend")


@dataclass(frozen=True)
class RunPlan:
    """``config``: what the user asked for, as checked (never rewritten); the rest: what
    the data decided (the task, the model's sizes, the steps per epoch) and the cluster
    (the workers, devices and backend: None before Ray is attached), the batch plan, and
    the run's folder.
    A resume or a resize resolves again; nothing else derives these."""

    config: TrainConfig
    task: str
    input_dim: int
    output_dim: int
    num_classes: Optional[int]
    batch: BatchPlan
    steps_per_epoch: int
    workers: Any = None  # N, or "MIN-MAX" for an elastic run
    gpus_per_worker: Optional[int] = None
    cpus_per_worker: Optional[int] = None
    backend: Optional[str] = None
    folder: Optional[RunFolder] = None  # the run's folder in its storage, once it is opened

    def planned(self) -> dict[str, Any]:
        """The plan's own values (PLANNED_FIELDS), as a checkpoint stores them."""
        return {name: self.batch.global_batch if name == "global_batch" else getattr(self, name)
                for name in PLANNED_FIELDS}

    def resolved_options(self) -> dict[str, Any]:
        """Every option as the run trains with it, as a tracker records it: the user's,
        with the plan's values in place of what they left to the data and the cluster.
        (Code reads the plan's values off the plan: ``run.task``, ``run.input_dim``, ...;
        the user's off ``run.config``.)"""
        return {**self.config.to_dict(), **self.planned()}


def saved_run_config(meta: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's run config: its intent with its plan's values (a checkpoint written
    before plans were stored apart holds the run config alone, as ``config``)."""
    return {**meta.get("config", {}), **meta.get("plan", {})}


@dataclass(frozen=True)
class WorkerPlan:
    """``run``: the RunPlan; ``resume_from``: the checkpoint folder the driver checked and
    announced, or None; ``newest_at_start``: the newest checkpoint folder when this fit
    began (a newer one was written by this fit); ``total_steps``: the global step the run's
    epochs end at (its schedule's span; ``last_step``: where it stops); ``objects``: what the Python API passed (model, train_data, val_data, loss),
    cloudpickled on the driver so Ray Train's controller only hands bytes on."""

    run: RunPlan
    resume_from: Optional[str]
    newest_at_start: Optional[str]
    total_steps: int
    objects: bytes = b""
    model_loss: bool = False  # batches hand the model its labels: its own loss is the objective
    init_from: Optional[str] = None  # a new run's first weights (--init-from)
    # the weights the run's first life started from (its --init-from), kept across its
    # resumes and restarts, which ignore --init-from: what a --lora run's adapters were
    # trained over (export/run.py); None: the model's own weights
    started_from: Optional[str] = None
    init_strict: bool = True
    hang_watch: Any = None  # the driver's HangWatch actor (--hang-timeout), or None: off
    ray_data: Any = None  # a RayDataTables when a set is read through Ray Data (data/ray_data.py)
    # this fit's in-memory snapshots' own folder on each node (checkpoint/snapshots.py): new at each fit
    snapshot_scope: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @property
    def last_step(self) -> int:
        """The global step the run stops at: ``total_steps``, or --max-steps where that
        comes first (the schedule still spans ``total_steps``: a larger --max-steps later
        continues the same run)."""
        max_steps = self.run.config.max_steps
        return self.total_steps if max_steps is None else min(self.total_steps, max_steps)

    def load_objects(self) -> dict[str, Any]:
        from ray import cloudpickle

        return cloudpickle.loads(self.objects) if self.objects else {}
