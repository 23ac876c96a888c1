"""WorkerPlan: all that crosses from the driver to a worker, typed. Made on the driver,
read on every worker (Ray pickles it into the trainer's train_loop_config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ray_ddp.config.train import TrainConfig


@dataclass(frozen=True)
class WorkerPlan:
    """``config``: the run's options as the driver resolved them for this cluster and its
    data (task, sizes, global batch, steps per epoch, placement); ``resume_from``: the
    checkpoint folder the driver checked and announced, or None; ``newest_at_start``: the
    newest checkpoint folder when this fit began (a newer one was written by this fit);
    ``total_steps``: the global step the run ends at; ``objects``: what the Python API
    passed (model, train_data, val_data, loss), cloudpickled on the driver so Ray Train's
    controller only hands bytes on."""

    config: TrainConfig
    resume_from: Optional[str]
    newest_at_start: Optional[str]
    total_steps: int
    objects: bytes = b""
    model_loss: bool = False  # batches hand the model its labels: its own loss is the objective
    init_from: Optional[str] = None  # a new run's first weights (--init-from)
    init_strict: bool = True
    hang_watch: Any = None  # the driver's HangWatch actor (--hang-timeout), or None: off
    ray_data: Any = None  # a RayDataConfig when a set is read through Ray Data (data/ray_data.py)

    def load_objects(self) -> dict[str, Any]:
        from ray import cloudpickle

        return cloudpickle.loads(self.objects) if self.objects else {}
