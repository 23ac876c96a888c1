"""FSDP checkpoints: every rank writes its own shards with torch.distributed.checkpoint
(tensors only) beside ``train_state.pt``; loading reads them back into the sharded
model. Runs on workers and in ``ray-ddp export``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional
import pyarrow.fs as pafs
import torch
import torch.distributed as dist
from torch import nn
from ray_ddp.checkpoint.format import HF_CONFIG_FILE, MODEL_FILE, STATE_FILE, TrainState, checkpoint_header, \
    hf_config_json, save_counted, to_cpu, write_counted, write_meta
from ray_ddp.errors import CheckpointError
from ray_ddp.checkpoint.verify import file_fingerprint
from ray_ddp.checkpoint.writer import CheckpointTimings
from ray_ddp.checkpoint.load import load_tensors
from ray_ddp.checkpoint.safe_load import DCP_METADATA, NON_TENSORS, weights_only_dcp


def is_sharded_checkpoint(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, DCP_METADATA))


@dataclass
class ShardedSnapshot:
    """One checkpoint under way: DCP's write (a Future), where it writes, and what rank 0
    adds (train_state.pt, model.pt, hf_config.json, meta.json's fields)."""

    future: Any
    folder: str  # local folder DCP writes into: the checkpoint itself, or a staging copy
    train_state: Optional[dict[str, Any]] = None
    model: Optional[dict[str, Any]] = None
    meta: Optional[dict[str, Any]] = None
    hf_config: Optional[str] = None  # a Hugging Face model's config (rank 0's, as in a DDP checkpoint)


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
        self.timings = CheckpointTimings()

    def idle(self) -> bool:
        return self._idle.is_set()

    def snapshot(self, model: nn.Module, optimizer: torch.optim.Optimizer, stateful: dict[str, Any],
                 state: TrainState, run: dict[str, Any], dir_name: str, final: bool,
                 rows: Optional[list] = None) -> ShardedSnapshot:
        """Start writing this rank's shards (training waits only for DCP's copy to host
        memory); at the run's end (``final``), also gather the whole model to rank 0
        (every rank takes part). ``rows``: every rank's metrics rows its report sends."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, \
            get_state_dict

        started = time.perf_counter()
        self._idle.wait()  # the previous upload's collectives come first on self.group
        self._idle.clear()
        folder = self.path_for(dir_name) if self.local else tempfile.mkdtemp(prefix="ray_ddp_shards_")
        model_state, optim_state = get_state_dict(model, optimizer)
        tensors, rest = split_tensors({"model": model_state, "optim": optim_state})
        future = dcp.async_save(tensors, storage_writer=dcp.FileSystemWriter(folder),
                                process_group=self.group)
        snapshot = ShardedSnapshot(future=future, folder=folder)
        if final:
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                        cpu_offload=True))
            snapshot.model = full if self.rank == 0 else None
        if self.rank == 0:
            header = checkpoint_header(state, run, 0, sharded=True)
            snapshot.train_state = {
                **header,
                "rng": state.rng,
                NON_TENSORS: to_cpu(rest),  # a copy: training goes on changing param_groups
                **{name: to_cpu(obj.state_dict()) for name, obj in stateful.items()},
                **({"rows": rows} if rows else {}),
            }
            snapshot.meta = header
            snapshot.hf_config = hf_config_json(model)
        self.timings.note("checkpoint_save_s", started)
        return snapshot

    def write(self, snapshot: ShardedSnapshot, dir_name: str) -> str:
        """On Ray's upload thread: finish this rank's part, then rank 0 writes the rest."""
        try:
            started = time.perf_counter()
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
                if snapshot.hf_config is not None:
                    files[HF_CONFIG_FILE] = write_counted(self.fs, f"{path}/{HF_CONFIG_FILE}",
                                                          snapshot.hf_config.encode())
                write_meta(self.fs, path, snapshot.meta, files)
            self.timings.note("checkpoint_upload_s", started)
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
    saved = load_tensors(os.path.join(directory, STATE_FILE))
    return apply_sharded_state(model, optimizer, stateful, saved, lambda tensors: load_shards(directory, tensors))


def apply_sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, stateful: Optional[dict[str, Any]],
                        saved: dict[str, Any], fill: Callable[[dict[str, Any]], None]) -> TrainState:
    """Load a sharded state into the sharded model and its optimizer: ``fill`` puts the
    tensors in place (DCP's read of a checkpoint, or a snapshot's local shards), ``saved``
    (train_state.pt) gives the rest: the optimizer's non-tensor entries, the schedule and
    scaler, the position."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    full = {"model": model_state, "optim": optim_state}
    if NON_TENSORS in saved:
        tensors, _ = split_tensors(full)  # filled in place
        fill(tensors)
        loaded = merge_into(tensors, saved[NON_TENSORS])
    else:  # the earlier format: the non-tensor entries are in the shards, read weights_only
        fill(full)
        loaded = full
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    for name, obj in (stateful or {}).items():
        if name in saved:
            obj.load_state_dict(saved[name])
    return TrainState(epoch=saved["epoch"], step=saved["step"], rng=saved["rng"], rows=saved.get("rows", []),
                      epoch_step=saved.get("epoch_step", 0))


def read_model_state(directory: str, into: Optional[dict[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """The whole model of a sharded checkpoint as a plain state_dict of CPU tensors, read
    in this one process (no process group): what ``ray-ddp export`` writes. ``into``:
    the tensors to read into (a model's own: --init-from), some of the checkpoint's."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader_class, _ = weights_only_dcp()
    reader = reader_class(directory)
    state = into
    if state is None:
        state = {key[len("model."):]: torch.empty(item.size, dtype=item.properties.dtype)
                 for key, item in reader.read_metadata().state_dict_metadata.items()
                 if key.startswith("model.") and isinstance(item, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "no process group: loading in a single process" is the point
        warnings.simplefilter("ignore", UserWarning)
        load_shards(directory, {"model": state}, reader=reader, no_dist=True)
    return state


def read_model_shapes(directory: str) -> dict[str, torch.Tensor]:
    """The model's tensors of a sharded checkpoint on the meta device, from DCP's
    metadata alone: names, shapes and dtypes, no shard read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader_class, _ = weights_only_dcp()
    return {key[len("model."):]: torch.empty(item.size, dtype=item.properties.dtype, device="meta")
            for key, item in reader_class(directory).read_metadata().state_dict_metadata.items()
            if key.startswith("model.") and isinstance(item, TensorStorageMetadata)}


def split_tensors(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two nested dicts of ``state``'s shape: its tensors (what DCP writes), and all else
    (lists such as ``param_groups`` whole), which train_state.pt holds."""
    tensors: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            tensors[key], rest[key] = split_tensors(value)
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            rest[key] = value
    return tensors, rest


def merge_into(tensors: dict[str, Any], rest: dict[str, Any]) -> dict[str, Any]:
    """Undo ``split_tensors``: ``rest``'s entries put back into ``tensors`` (in place)."""
    for key, value in rest.items():
        if isinstance(value, dict) and isinstance(tensors.get(key), dict):
            merge_into(tensors[key], value)
        else:
            tensors[key] = value
    return tensors


def load_shards(directory: str, state: dict[str, Any], reader: Any = None, no_dist: bool = False) -> None:
    """``dcp.load`` of ``state``, but never unpickling code: ``.metadata`` is read (and
    refused) before DCP starts, so a refusal is this one CheckpointError on every rank,
    not a per-rank traceback DCP gathers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader_class, planner_class = weights_only_dcp()
    reader = reader or reader_class(directory)
    reader.read_metadata()
    try:
        dcp.load(state, storage_reader=reader, planner=planner_class(directory), no_dist=no_dist)
    except CheckpointException as err:  # a refused entry, wrapped by DCP per rank
        refused = [e for e, _ in err.failures.values() if isinstance(e, CheckpointError)]
        if refused:
            raise refused[0] from None
        raise
