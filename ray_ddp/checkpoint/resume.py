"""Which checkpoint a worker resumes from: the one the driver checked and announced,
or, after a restart within the run, the newer one Ray hands back; the same on every rank.
Runs on workers.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ray_ddp.checkpoint.agree import collective_device, reduced, usable_on_every_rank
from ray_ddp.checkpoint.format import TrainState
from ray_ddp.record.names import checkpoint_dir_name, checkpoint_step
from ray_ddp.checkpoint.shard_snapshots import load_shard_snapshot
from ray_ddp.checkpoint.sharded import is_sharded_checkpoint
from ray_ddp.checkpoint.snapshots import fetch_snapshot, newest_snapshot, node_folder
from ray_ddp.checkpoint.verify import verify_checkpoint
from ray_ddp.config.train import TrainConfig
from ray_ddp.errors import CheckpointError, StorageError
from ray_ddp.record.folder import RunFolder
from ray_ddp.storage import local_copy


def load_checkpoint_to_resume(cfg: TrainConfig, folder: RunFolder, resume_from: Optional[str],
                              newest_at_start: Optional[str],
                              latest: Optional[Any], strategy, model: nn.Module,
                              optimizer: torch.optim.Optimizer, stateful: dict,
                              node_id: Optional[str] = None, snapshot_scope: str = "") -> TrainState:
    """Load into the model, through the strategy that wrote it (bare under DDP, sharded in
    place under FSDP), the checkpoint the driver checked and announced (``resume_from``, in
    ``folder``: the run's, its filesystem carried in the plan),
    or, after a restart within this run, the newer one Ray hands back (``latest``, a
    ``ray.train.Checkpoint``, used when newer than any that existed when the run began);
    a fresh TrainState if neither.
    Every file is checked against its meta.json (size and CRC-32) before it is loaded, and
    every rank loads the same one: the newest that every rank could read. Newest of all,
    where it is newer than those: the newest in-memory snapshot (--snapshot-every-steps) on
    any rank's node, sent to the nodes that lack it (``node_id``: this rank's node; the
    state's ``loaded_from_node`` names the node the snapshot came from)."""
    candidates = []  # (its folder's path, what opens it on this machine)
    stored_steps = [checkpoint_step(_dir_name(latest.path))] if latest is not None else []
    stored_steps.append(checkpoint_step(resume_from or ""))
    state = _load_snapshot(node_folder(cfg.storage, cfg.name, snapshot_scope), max(stored_steps), strategy,
                           model, optimizer, stateful, node_id)
    if state is not None:
        return state
    if latest is not None and _dir_name(latest.path) > (newest_at_start or ""):
        # written by this run before a worker died; Ray's Checkpoint: on remote storage,
        # one download per node, shared by its ranks
        candidates.append((latest.path, latest.as_directory))
    if resume_from is not None:
        path = f"{folder.path}/{resume_from}"
        candidates.append((path, functools.partial(local_copy, folder.fs, path)))
    problems = []
    for path, open_folder in candidates:
        with contextlib.ExitStack() as stack:
            try:
                directory = stack.enter_context(open_folder())
            except FileNotFoundError:  # remote storage: a folder deleted since it was named
                directory, problem = None, "its folder is gone"
            except (OSError, StorageError) as err:  # a transient read on this rank's node
                directory, problem = None, f"it could not be read ({type(err).__name__}: {err})"
            else:
                problem = _problem_of(directory, strategy)
            # every rank takes the same one: a rank that cannot read it (a transient remote
            # read) makes them all go on to the next, never a mix of steps across the ranks
            if usable_on_every_rank(problem is None):
                state = strategy.load_checkpoint(directory, model, optimizer, stateful)
                state.loaded_from = _dir_name(path)
                return state
        problems.append(f"{_dir_name(path)}: {problem or 'another rank could not read it'}")
    if problems:
        raise CheckpointError("no usable checkpoint to resume from: " + "; ".join(problems))
    return TrainState()


def _load_snapshot(folder: str, stored_step: int, strategy, model: nn.Module, optimizer: torch.optim.Optimizer,
                   stateful: dict, node_id: Optional[str]) -> Optional[TrainState]:
    """The newest snapshot of the run on any rank's node, loaded on every rank, where it is
    at least as new as ``stored_step`` (the newest checkpoint in storage a rank could
    resume from); else None. A rank whose node lacks it gets it from the lowest rank whose node
    holds it; where any rank's copy is not whole, every rank goes on to run storage."""
    if not dist.is_initialized():
        return None
    if strategy.checkpoint_format == "sharded":  # each rank's shards, on the nodes of their ranks
        state = load_shard_snapshot(folder, stored_step, model, optimizer, stateful, node_id)
        if state is not None:
            state.loaded_from = checkpoint_dir_name(state.step)
        return state
    rank, world = dist.get_rank(), dist.get_world_size()
    found = newest_snapshot(folder)
    newest = int(reduced(found.step if found else 0, dist.ReduceOp.MAX))
    if newest == 0 or newest < stored_step:  # at the same step, memory: read in a moment, never from storage
        return None
    holds = found is not None and found.step == newest
    path, source_node = (found.folder if holds else None), node_id
    fetched = os.path.join(folder, f"fetched-r{rank}")
    try:
        if not usable_on_every_rank(holds):  # a node lacks it: sent from the lowest rank's that holds it
            holder = int(reduced(rank if holds else world, dist.ReduceOp.MIN))
            path, source_node = fetch_snapshot(path, holder, fetched, node_id, collective_device())
        if not usable_on_every_rank(path is not None):
            if rank == 0:
                print(f"the snapshot of step {newest} could not be sent whole to every rank: resuming from "
                      "run storage", flush=True)
            return None
        state = strategy.load_checkpoint(path, model, optimizer, stateful)
    finally:
        shutil.rmtree(fetched, ignore_errors=True)  # read: the node's own slots hold what it takes next
    state.loaded_from, state.loaded_from_node = checkpoint_dir_name(newest), source_node
    return state


def _problem_of(directory: str, strategy) -> Optional[str]:
    """What keeps this rank from loading the local checkpoint folder; None if nothing."""
    sharded = strategy.checkpoint_format == "sharded"
    problem = verify_checkpoint(directory, shards_by_size=sharded)
    if problem is None and is_sharded_checkpoint(directory) != sharded:  # (the driver refuses it first)
        problem = f"not a checkpoint of --strategy {strategy.name}"
    return problem


def check_ranks_resumed_alike(step: int, weights_hash: Callable[[], int]) -> Optional[int]:
    """Stop every rank (one CheckpointError each) unless all of them start from the same
    step with the same weights: a mix would train on without a word. The steps are
    compared first, so that ``weights_hash`` (a collective under FSDP) runs on every rank
    or on none. The weights' hash of a resumed run (None for a new one)."""
    grouped = dist.is_initialized()
    if grouped:
        _same_on_every_rank(step, "steps")
    if not step:
        return None
    loaded = weights_hash()
    if grouped:
        _same_on_every_rank(loaded, "weights at the same step")
    return loaded


def _same_on_every_rank(value: int, what: str) -> None:
    """One all-reduce of ``value`` and its negation (a 48-bit hash is exact in a float64)."""
    spread = torch.tensor([float(value), -float(value)], dtype=torch.float64, device=collective_device())
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    most, least = spread[0].item(), -spread[1].item()
    if most != least:
        shown = f" {int(least)} to {int(most)}" if what == "steps" else ""
        raise CheckpointError(
            f"the ranks resumed from different {what}{shown}: a rank loaded another checkpoint than the "
            "others; run the same command again to resume from the newest whole one")


def _dir_name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]
