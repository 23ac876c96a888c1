"""Checkpoint files: what rank 0 writes and what every rank (and the driver) reads back.

A checkpoint is a folder ``step-<global step>`` in the run directory holding
- ``model.pt``: the bare model's ``state_dict`` (CPU tensors, no ``module.`` prefix),
  loadable with ``torch.load(path, weights_only=True)`` without ray_ddp installed;
- ``train_state.pt``: optimizer state, epoch, global step, every rank's RNG state, config;
- ``meta.json``: epoch, step, config, and the size and CRC-32 of the two tensor files,
  in plain JSON, so the driver finds the latest checkpoint without loading tensors.
A checkpoint counts only if its meta.json is there and the files match it: a write cut
short (a crash mid-upload, a truncated file) is named and skipped, never loaded.
Saving is two halves, so training need not wait for the disk: ``snapshot_checkpoint``
copies the state to host memory on the training thread, ``write_checkpoint`` writes the
files (the loop runs it in Ray's upload thread). Both, and ``load_checkpoint``, run on
workers; ``find_latest_checkpoint`` on the driver. Every load uses ``weights_only=True``: no pickled code ever runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import pyarrow.fs as pafs
import torch
from torch import nn

from .storage import read_json

MODEL_FILE = "model.pt"
STATE_FILE = "train_state.pt"
META_FILE = "meta.json"


@dataclass
class TrainState:
    """Where training stands: epochs fully done and optimizer steps taken so far."""

    epoch: int = 0
    step: int = 0
    # steps taken in the epoch under way, counted, never derived from steps per epoch: a
    # resume on another world size (or batch) has other steps per epoch
    epoch_step: int = 0
    # one entry per rank: {"torch": ByteTensor, "cuda": [ByteTensor per own GPU]}
    rng: list[dict[str, Any]] = field(default_factory=list)


def checkpoint_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def capture_rng(devices: Sequence[torch.device] = ()) -> dict[str, Any]:
    """This process's RNG state, so a resumed rank draws what it would have drawn: the
    CPU's, and that of this worker's own GPUs (in the order of ``devices``), never every
    visible GPU's: a resume may land on a node with fewer."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    gpus = _distinct_gpus(devices)
    if gpus:
        state["cuda"] = [torch.cuda.get_rng_state(d) for d in gpus]
    return state


def restore_rng(state: dict[str, Any], devices: Sequence[torch.device] = ()) -> None:
    """Put back what ``capture_rng`` took, GPU by GPU onto this worker's own devices."""
    torch.set_rng_state(state["torch"])
    for device, gpu_state in zip(_distinct_gpus(devices), state.get("cuda", [])):
        torch.cuda.set_rng_state(gpu_state, device)


def _distinct_gpus(devices: Sequence[torch.device]) -> list[torch.device]:
    return list(dict.fromkeys(d for d in devices if d.type == "cuda"))


def to_cpu(obj: Any, into: Any = None) -> Any:
    """A copy with every tensor on the CPU, so a GPU checkpoint loads on any machine. A
    copy even of CPU tensors: training goes on changing the originals while it is
    written. ``into``: an earlier copy of the same structure, whose tensors are reused
    (no fresh allocation, no page faults on hundreds of MB at every checkpoint)."""
    if isinstance(obj, torch.Tensor):
        if isinstance(into, torch.Tensor) and into.shape == obj.shape and into.dtype == obj.dtype:
            return into.copy_(obj.detach())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        into = into if isinstance(into, dict) else {}
        return {k: to_cpu(v, into.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        into = into if isinstance(into, type(obj)) and len(into) == len(obj) else [None] * len(obj)
        return type(obj)(to_cpu(v, w) for v, w in zip(obj, into))
    return obj


@dataclass
class CheckpointSnapshot:
    """A checkpoint's contents copied to host memory, ready to be written while training
    goes on: what model.pt and train_state.pt will hold, and meta.json's fields."""

    model: dict[str, Any]
    train_state: dict[str, Any]
    meta: dict[str, Any]


def snapshot_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainState,
                        config: dict[str, Any], rank: int, stateful: Optional[dict[str, Any]] = None,
                        reuse: Optional[CheckpointSnapshot] = None) -> CheckpointSnapshot:
    """Copy everything a checkpoint holds (one memory copy of weights and optimizer
    state). ``stateful``: more objects with state_dict() (LR schedule, gradient scaler).
    ``reuse``: a snapshot already written, whose memory the copy goes into."""
    return CheckpointSnapshot(
        model=to_cpu(model.state_dict(), reuse.model if reuse else None),
        train_state={
            "optimizer": to_cpu(optimizer.state_dict(), reuse.train_state["optimizer"] if reuse else None),
            "epoch": state.epoch,
            "step": state.step,
            "epoch_step": state.epoch_step,
            "rng": state.rng,
            "config": config,
            "saved_by_rank": rank,
            **{name: to_cpu(obj.state_dict()) for name, obj in (stateful or {}).items()},
        },
        meta={"epoch": state.epoch, "step": state.step, "epoch_step": state.epoch_step,
              "world_size": len(state.rng),
              "saved_by_rank": rank, "config": config},
    )


def write_checkpoint(directory: str, snapshot: CheckpointSnapshot,
                     fs: Optional[pafs.FileSystem] = None) -> None:
    """Write the three files into ``directory`` (on ``fs``: any pyarrow filesystem, the
    local disk by default), straight to where they stay. meta.json comes last, with each
    file's size and CRC-32 (counted as the bytes go out, not read back), so a folder cut
    short is recognised as such."""
    fs = fs or pafs.LocalFileSystem()
    fs.create_dir(directory, recursive=True)
    files = {name: save_counted(fs, f"{directory}/{name}", obj)
             for name, obj in ((MODEL_FILE, snapshot.model), (STATE_FILE, snapshot.train_state))}
    write_meta(fs, directory, snapshot.meta, files)


def save_counted(fs: pafs.FileSystem, path: str, obj: Any) -> dict[str, int]:
    """torch.save ``obj`` to ``path`` on ``fs``; its size and CRC-32, counted as the bytes go out."""
    with fs.open_output_stream(path, buffer_size=1 << 20) as stream:
        counted = CountingWriter(stream)
        torch.save(obj, counted)
    return {"bytes": counted.bytes, "crc32": counted.crc32}


def write_meta(fs: pafs.FileSystem, directory: str, meta: dict[str, Any], files: dict[str, Any]) -> None:
    """meta.json, the last file of a checkpoint: ``meta``, the time, and every file's
    size and CRC-32 (``files``)."""
    with fs.open_output_stream(f"{directory}/{META_FILE}") as stream:
        stream.write(json.dumps({**meta, "time": time.time(), "files": files}).encode())


class CountingWriter:
    """A write-only file for torch.save that counts the bytes and their CRC-32."""

    def __init__(self, stream):
        self.stream, self.bytes, self.crc32 = stream, 0, 0

    def write(self, data) -> int:
        self.crc32 = zlib.crc32(data, self.crc32)
        self.bytes += len(data)
        return self.stream.write(data)

    def flush(self) -> None:
        pass  # the stream flushes when it closes


def save_checkpoint(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: TrainState, config: dict[str, Any], rank: int,
                    stateful: Optional[dict[str, Any]] = None) -> None:
    """Snapshot and write in one go (the loop writes its snapshots off the training thread)."""
    write_checkpoint(directory, snapshot_checkpoint(model, optimizer, state, config, rank, stateful))


class CheckpointError(RuntimeError):
    """A checkpoint that must not be loaded: cut short, corrupt, or holding pickled code."""


def file_fingerprint(path: str) -> dict[str, int]:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return {"bytes": os.path.getsize(path), "crc32": crc}


def verify_checkpoint(directory: str, shards_by_size: bool = False) -> Optional[str]:
    """None if the local checkpoint folder is whole, else what is wrong with it.
    ``shards_by_size``: FSDP shard files (``*.distcp``) are checked by size only: each
    rank reads only its part of them, and the driver checked every byte before the run."""
    meta_path = os.path.join(directory, META_FILE)
    if not os.path.isfile(meta_path):
        return f"{META_FILE} is missing (a write that never finished)"
    try:
        with open(meta_path) as f:
            files = json.load(f)["files"]
    except (ValueError, KeyError, TypeError):
        return f"{META_FILE} is unreadable"
    for name, want in files.items():
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if shards_by_size and name.endswith(".distcp"):
            size = os.path.getsize(path)
            if size != want["bytes"]:
                return f"{name} has {size} bytes, {want['bytes']} were written"
            continue
        got = file_fingerprint(path)
        if got["bytes"] != want["bytes"]:
            return f"{name} has {got['bytes']} bytes, {want['bytes']} were written"
        if got["crc32"] != want["crc32"]:
            return f"{name} is corrupt (CRC-32 mismatch)"
    return None


def load_tensors(path: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # UnpicklingError for pickled objects, RuntimeError for bad zips
        if "weights_only" in str(err) or "Unsupported global" in str(err):
            raise CheckpointError(
                f"refusing to load {path}: it holds pickled objects, not just tensors "
                "(only weights_only=True loads are allowed)"
            ) from None
        raise CheckpointError(f"cannot load {path}: {str(err).splitlines()[0]}") from None


def load_checkpoint(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                    stateful: Optional[dict[str, Any]] = None) -> TrainState:
    """Load the files of ``directory`` into the bare (not yet DDP-wrapped) model and optimizer."""
    weights = load_tensors(os.path.join(directory, MODEL_FILE))
    model.load_state_dict(weights)
    saved = load_tensors(os.path.join(directory, STATE_FILE))
    optimizer.load_state_dict(saved["optimizer"])
    for name, obj in (stateful or {}).items():
        if name in saved:
            obj.load_state_dict(saved[name])
    return TrainState(epoch=saved["epoch"], step=saved["step"], rng=saved["rng"],
                      epoch_step=saved.get("epoch_step", 0))


@dataclass
class CheckpointScan:
    """The checkpoints of a run folder, newest first: the first whole one, and the broken."""

    latest: Optional[str] = None
    meta: Optional[dict[str, Any]] = None
    broken: list[tuple[str, str]] = field(default_factory=list)  # (folder, what is wrong)
    newest: Optional[str] = None  # the newest step folder, whole or not


def find_latest_checkpoint(fs, run_path: str, verify_crc: bool = False) -> CheckpointScan:
    """Scan ``step-*`` folders newest first; the first whose files match its meta.json wins.

    Sizes are always compared; ``verify_crc`` also reads every file and compares its
    CRC-32 (what the driver does before it trusts a checkpoint to resume from: a file of
    the right size may still be corrupt).
    """
    from pyarrow.fs import FileSelector, FileType

    scan = CheckpointScan()
    try:
        infos = fs.get_file_info(FileSelector(run_path, allow_not_found=True))
    except FileNotFoundError:
        return scan
    names = sorted(
        (i.base_name for i in infos if i.type == FileType.Directory and i.base_name.startswith("step-")),
        reverse=True,
    )
    scan.newest = names[0] if names else None
    for name in names:
        try:
            meta = read_json(fs, f"{run_path}/{name}/{META_FILE}")
        except ValueError:  # not JSON: a torn write (a read failure is raised, not guessed at)
            meta = None
        problem = checkpoint_file_problem(fs, f"{run_path}/{name}", meta, verify_crc)
        if problem is None:
            scan.latest, scan.meta = name, meta
            return scan
        scan.broken.append((name, problem))
    return scan


def checkpoint_file_problem(fs, path: str, meta: Optional[dict[str, Any]], verify_crc: bool) -> Optional[str]:
    from pyarrow.fs import FileType

    if meta is None or not isinstance(meta.get("files"), dict):
        return f"{META_FILE} is missing or unreadable (a write that never finished)"
    for name, want in meta["files"].items():
        info = fs.get_file_info(f"{path}/{name}")
        if info.type != FileType.File:
            return f"{name} is missing"
        if info.size != want["bytes"]:
            return f"{name} has {info.size} bytes, {want['bytes']} were written"
        if verify_crc and _stream_crc32(fs, f"{path}/{name}") != want["crc32"]:
            return f"{name} is corrupt (CRC-32 mismatch)"
    return None


def _stream_crc32(fs, path: str) -> int:
    crc = 0
    with fs.open_input_stream(path) as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def weights_hash(model: nn.Module) -> int:
    """A 48-bit fingerprint of the whole weights: equal on every rank iff DDP kept them
    in sync; under FSDP the same for a model however it is sharded. It is taken at every
    epoch end, so it reads each tensor's bytes once, in place, with zlib's CRC-32 (0.06 s
    for 50M parameters here; SHA-256 over a copy of them took 0.3-0.45 s), and SHA-256
    only combines those per-tensor sums with the names. It tells diverged weights
    apart, not an adversary's."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):  # FSDP's DTensor: gathered (a collective, every rank)
            tensor = tensor.full_tensor()
        # reshape(-1): a 0-dim tensor (BatchNorm's num_batches_tracked) cannot be viewed as bytes
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        h.update(f"{name}:{data.size}:{zlib.crc32(data)};".encode())
    return int(h.hexdigest()[:12], 16)  # 48 bits: exact as a float64 metric
