"""Sharded checkpoints (``--strategy fsdp``): every rank writes its own shards.

A sharded checkpoint is a ``step-<global step>`` folder like a DDP one (checkpoint.py),
holding
- ``.metadata`` and ``__<rank>_0.distcp``: the model and optimizer state as
  ``torch.distributed.checkpoint`` (DCP) writes it, each rank its own shards; DCP
  reshards on load, so a checkpoint of 2 ranks resumes on 1 or on 3;
- ``train_state.pt``: epoch, step, every rank's RNG, LR schedule, config (rank 0);
- ``model.pt`` in the last checkpoint of a run: the whole model gathered into a plain
  ``state_dict`` (unless ``--skip-final-model``); ``ray-ddp export`` makes one from any;
- ``meta.json``: as for DDP, the size and CRC-32 of every file above, written last.

Saving (``ShardedCheckpointWriter``, on every worker): on the training thread,
``dcp.async_save`` copies this rank's shards to host memory and returns; a DCP thread
writes them while training goes on. Ray's upload thread then waits for that write,
fingerprints this rank's files, and, over a process group of its own (gloo, so it never
mixes with the training collectives), gathers every rank's fingerprints to rank 0, which
writes train_state.pt and meta.json. Every rank reports the same folder to Ray, which
counts it as one checkpoint once every rank's upload returned.

Loading runs on workers (``load_sharded_checkpoint``) and, with no process group at all,
on the driver (``read_model_state``, for ``ray-ddp export``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pyarrow.fs as pafs
import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import MODEL_FILE, STATE_FILE, TrainState, file_fingerprint, load_tensors, save_counted, \
    to_cpu, write_meta

DCP_METADATA = ".metadata"


def is_sharded_checkpoint(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, DCP_METADATA))


@dataclass
class ShardedSnapshot:
    """One checkpoint under way: DCP's write (a Future), where it writes, and what rank 0
    adds (train_state.pt, model.pt, meta.json's fields)."""

    future: Any
    folder: str  # local folder DCP writes into: the checkpoint itself, or a staging copy
    train_state: Optional[dict[str, Any]] = None
    model: Optional[dict[str, Any]] = None
    meta: Optional[dict[str, Any]] = None


class ShardedCheckpointWriter:
    """The FSDP counterpart of CheckpointWriter: one per rank, one checkpoint at a time."""

    def __init__(self, fs: pafs.FileSystem, path_for: Callable[[str], str], rank: int):
        self.fs, self.path_for, self.rank = fs, path_for, rank
        self.local = isinstance(fs, pafs.LocalFileSystem)
        # the upload threads' collectives go over a group of their own, created by every
        # rank at the same point (here, at start-up)
        self.group = dist.new_group(backend="gloo")
        self._idle = threading.Event()
        self._idle.set()

    def idle(self) -> bool:
        return self._idle.is_set()

    def snapshot(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainState,
                 config: dict[str, Any], stateful: dict[str, Any], dir_name: str,
                 with_model: bool) -> ShardedSnapshot:
        """Start writing this rank's shards (training waits only for DCP's copy to host
        memory); with ``with_model``, also gather the whole model to rank 0 (every rank
        takes part)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, \
            get_state_dict

        self._idle.wait()  # the previous upload's collectives come first on self.group
        self._idle.clear()
        folder = self.path_for(dir_name) if self.local else tempfile.mkdtemp(prefix="ray_ddp_shards_")
        model_state, optim_state = get_state_dict(model, optimizer)
        future = dcp.async_save({"model": model_state, "optim": optim_state},
                                storage_writer=dcp.FileSystemWriter(folder), process_group=self.group)
        snapshot = ShardedSnapshot(future=future, folder=folder)
        if with_model:
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                        cpu_offload=True))
            snapshot.model = full if self.rank == 0 else None
        if self.rank == 0:
            snapshot.train_state = {
                "epoch": state.epoch, "step": state.step, "epoch_step": state.epoch_step,
                "rng": state.rng, "config": config, "saved_by_rank": 0, "format": "sharded",
                **{name: to_cpu(obj.state_dict()) for name, obj in stateful.items()},
            }
            snapshot.meta = {"epoch": state.epoch, "step": state.step, "epoch_step": state.epoch_step,
                             "world_size": len(state.rng), "saved_by_rank": 0, "config": config,
                             "format": "sharded"}
        return snapshot

    def write(self, snapshot: ShardedSnapshot, dir_name: str) -> str:
        """On Ray's upload thread: finish this rank's part, then rank 0 writes the rest."""
        try:
            path = self.path_for(dir_name)
            snapshot.future.result()  # DCP's write: after it, every rank's shards are whole
            mine = {name: file_fingerprint(os.path.join(snapshot.folder, name))
                    for name in os.listdir(snapshot.folder) if self._wrote(name)}
            if not self.local:
                self.fs.create_dir(path, recursive=True)
                for name in mine:
                    pafs.copy_files(os.path.join(snapshot.folder, name), f"{path}/{name}",
                                    destination_filesystem=self.fs)
                shutil.rmtree(snapshot.folder, ignore_errors=True)
            everyone: list = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(everyone, mine, group=self.group)
            if self.rank == 0:
                files = {name: fp for part in everyone for name, fp in part.items()}
                for name, obj in ((STATE_FILE, snapshot.train_state), (MODEL_FILE, snapshot.model)):
                    if obj is not None:
                        files[name] = save_counted(self.fs, f"{path}/{name}", obj)
                write_meta(self.fs, path, snapshot.meta, files)
            return path
        finally:
            self._idle.set()

    def _wrote(self, name: str) -> bool:
        """DCP names rank r's files __r_<i>.distcp; the coordinator (rank 0) writes .metadata."""
        return name.startswith(f"__{self.rank}_") or (self.rank == 0 and name == DCP_METADATA)


def load_sharded_checkpoint(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                            stateful: Optional[dict[str, Any]] = None) -> TrainState:
    """Load a sharded checkpoint into the sharded model and its optimizer (every rank
    reads the parts of the shards it now holds, whatever the world size that wrote them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    loaded = {"model": model_state, "optim": optim_state}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(directory))
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    saved = load_tensors(os.path.join(directory, STATE_FILE))
    for name, obj in (stateful or {}).items():
        if name in saved:
            obj.load_state_dict(saved[name])
    return TrainState(epoch=saved["epoch"], step=saved["step"], rng=saved["rng"],
                      epoch_step=saved.get("epoch_step", 0))


def read_model_state(directory: str) -> dict[str, torch.Tensor]:
    """The whole model of a sharded checkpoint as a plain state_dict of CPU tensors, read
    in this one process (no process group): what ``ray-ddp export`` writes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(directory)
    metadata = reader.read_metadata()
    state: dict[str, torch.Tensor] = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata):
            state[key[len("model."):]] = torch.empty(item.size, dtype=item.properties.dtype)
    with warnings.catch_warnings():  # "no process group: loading in a single process" is the point
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": state}, storage_reader=reader, no_dist=True)
    return state
