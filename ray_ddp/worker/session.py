"""The worker's one door to Ray Train: who this rank is, where checkpoints go, a report
(with or without a checkpoint), the checkpoint Ray hands back after a restart, a node's
preemption, the GPUs. Runs on workers.

The loop and its parts meet Ray Train only through a session, so this file lists the
calls they make into it; the two others a worker may make are an option's own: Ray
Data's shard (--ray-data, data/ray_data.py) and the beats to the hang watch's actor
(worker/heartbeat.py). ``RayTrainSession`` is the real one; the tests' gloo harness
(``tests/helpers/gloo_run.py``) gives the same loop a session of plain processes, to
check ray_ddp's own arithmetic without paying for a Ray Train run.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import ray
import ray.train
import ray.train.torch
import torch


# the longest a report waits to be taken by the controller (it polls every second: runtime_env.py)
TAKEN_WITHIN_S = 5.0
# How long a report that alone holds rows waits to be taken (an elastic restart's carried
# windows): the controller takes one each second; past this, it is gone too.
HOLDING_ROWS_WITHIN_S = 120.0


@dataclass(frozen=True)
class PreemptionNotice:
    """Ray's word that nodes of this run are being drained: which, and by when (ms since
    the epoch; 0 when the drain named no deadline)."""

    node_ids: tuple[str, ...]
    deadline_ms: int


class RayTrainSession:
    """The worker's session in a Ray Train run (ray.train's context, report, checkpoint
    and preemption calls)."""

    def __init__(self) -> None:
        ctx = ray.train.get_context()
        self.rank, self.world_size, self.node_rank = ctx.get_world_rank(), ctx.get_world_size(), ctx.get_node_rank()
        self.local_rank = ctx.get_local_rank()  # on its node: the lowest writes the node's snapshots
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        storage = ctx.get_storage()
        # where this run's checkpoints go: a filesystem, and the path of a checkpoint's folder
        self.fs, self.checkpoint_path = storage.storage_filesystem, storage.build_checkpoint_path_from_name

    def gpus(self) -> list[torch.device]:
        return list(ray.train.torch.get_devices())

    def latest_checkpoint(self) -> Optional[Any]:
        """The newest checkpoint this run reported (a ``ray.train.Checkpoint``): after a
        restart within the run, Ray hands it back; None before the first."""
        return ray.train.get_checkpoint()

    def report(self, metrics: dict[str, Any], checkpoint_name: Optional[str] = None,
               write: Optional[Callable[[str], str]] = None) -> None:
        """Send ``metrics`` (a barrier: every rank reports at the same steps). With
        ``write``, this rank's checkpoint: Ray's upload thread calls ``write(dir_name)``,
        which writes the files into run storage and returns the folder, while training
        goes on (ASYNC); Ray needs a local folder to hand that thread, an empty one here,
        which it deletes. Reports stay in order, so each checkpoint is whole before it counts."""
        if write is None:
            ray.train.report(metrics, checkpoint=None, checkpoint_dir_name=checkpoint_name)
            return
        fs = self.fs

        def upload(_local: ray.train.Checkpoint, dir_name: str) -> ray.train.Checkpoint:
            return ray.train.Checkpoint(write(dir_name), fs)

        empty = ray.train.Checkpoint.from_directory(tempfile.mkdtemp(prefix="ray_ddp_ckpt_"))
        ray.train.report(metrics, checkpoint=empty, checkpoint_dir_name=checkpoint_name,
                         checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC, checkpoint_upload_fn=upload)

    def report_and_wait(self, metrics: dict[str, Any], holds_rows: bool = False) -> None:
        """Report ``metrics`` (no checkpoint) and wait, at most TAKEN_WITHIN_S, until Ray
        Train's controller has taken them: Ray drops a report its controller has not yet
        polled when the worker dies, and a group that fails at once must still have told
        the driver where it started. ``holds_rows``: the report is the only place some
        metrics rows are (no snapshot of this group holds them): up to HOLDING_ROWS_WITHIN_S."""
        ray.train.report(metrics, checkpoint=None)
        try:  # Ray Train V2's queue of reports to the controller (one at most): internal
            from ray.train.v2._internal.execution.context import get_train_context

            reports = get_train_context().get_result_queue()
        except Exception:  # moved in another Ray: the report still goes, unwaited
            return
        deadline = time.monotonic() + (HOLDING_ROWS_WITHIN_S if holds_rows else TAKEN_WITHIN_S)
        while reports.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)

    def preemption(self) -> Optional[PreemptionNotice]:
        """A drain of a node of this run, or None. A barrier through Ray: every rank asks at once."""
        info = ray.train.get_preemption_info()
        if info is None:
            return None
        return PreemptionNotice(tuple(info.preempted_node_ids), info.deadline_ms or 0)
