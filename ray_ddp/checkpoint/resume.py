"""Which checkpoint a worker resumes from: the one the driver checked and announced,
or, after a restart within the run, the newer one Ray hands back. Runs on workers.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Optional

import torch
from torch import nn

from ray_ddp.checkpoint.format import TrainState
from ray_ddp.checkpoint.sharded import is_sharded_checkpoint
from ray_ddp.checkpoint.verify import verify_checkpoint
from ray_ddp.config.train import TrainConfig
from ray_ddp.errors import CheckpointError
from ray_ddp.storage import local_copy, resolve_storage


def load_checkpoint_to_resume(cfg: TrainConfig, resume_from: Optional[str], newest_at_start: Optional[str],
                              latest: Optional[Any], strategy, model: nn.Module,
                              optimizer: torch.optim.Optimizer, stateful: dict) -> TrainState:
    """Load into the model, through the strategy that wrote it (bare under DDP, sharded in
    place under FSDP), the checkpoint the driver checked and announced (``resume_from``),
    or, after a restart within this run, the newer one Ray hands back (``latest``, a
    ``ray.train.Checkpoint``, used when newer than any that existed when the run began);
    a fresh TrainState if neither.
    Every file is checked against its meta.json (size and CRC-32) before it is loaded."""
    store = resolve_storage(cfg.storage)
    candidates = []  # (its folder's path, what opens it on this machine)
    if latest is not None and _dir_name(latest.path) > (newest_at_start or ""):
        # written by this run before a worker died; Ray's Checkpoint: on remote storage,
        # one download per node, shared by its ranks
        candidates.append((latest.path, latest.as_directory))
    if resume_from is not None:
        path = f"{store.run_path(cfg.name)}/{resume_from}"
        candidates.append((path, functools.partial(local_copy, store.fs, path)))
    problems = []
    for path, open_folder in candidates:
        with contextlib.ExitStack() as stack:
            try:
                directory = stack.enter_context(open_folder())
            except FileNotFoundError:  # remote storage: a folder deleted since it was named
                problems.append(f"{_dir_name(path)}: its folder is gone")
                continue
            sharded = strategy.checkpoint_format == "sharded"
            problem = verify_checkpoint(directory, shards_by_size=sharded)
            if problem is None and is_sharded_checkpoint(directory) != sharded:  # (the driver refuses it first)
                problem = f"not a checkpoint of --strategy {strategy.name}"
            if problem is None:
                return strategy.load_checkpoint(directory, model, optimizer, stateful)
        problems.append(f"{_dir_name(path)}: {problem}")
    if problems:
        raise CheckpointError("no usable checkpoint to resume from: " + "; ".join(problems))
    return TrainState()


def _dir_name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]
