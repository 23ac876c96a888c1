"""Checkpoint files: what rank 0 writes and what every rank (and the driver) reads back.

A checkpoint is a folder ``step-<global step>`` in the run directory holding
- ``model.pt``: the bare model's ``state_dict`` (CPU tensors, no ``module.`` prefix),
  loadable with ``torch.load(path, weights_only=True)`` without ray_ddp installed;
- ``train_state.pt``: optimizer state, epoch, global step, every rank's RNG state, config;
- ``meta.json``: epoch, step, config, and the size and CRC-32 of the two tensor files,
  in plain JSON, so the driver finds the latest checkpoint without loading tensors.
A checkpoint counts only if its meta.json is there and the files match it: a write cut
short (a crash mid-upload, a truncated file) is named and skipped, never loaded.
``save_checkpoint`` and ``load_checkpoint`` run on workers; ``find_latest_checkpoint``
on the driver. Every load uses ``weights_only=True``: no pickled code ever runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Optional

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
    # one entry per rank: {"torch": ByteTensor, "cuda": [ByteTensor, ...]}
    rng: list[dict[str, Any]] = field(default_factory=list)


def checkpoint_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def capture_rng() -> dict[str, Any]:
    """This process's RNG state, so a resumed rank draws what it would have drawn."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_cpu(obj: Any) -> Any:
    """A copy with every tensor on the CPU, so a GPU checkpoint loads on any machine."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def save_checkpoint(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: TrainState, config: dict[str, Any], rank: int,
                    stateful: Optional[dict[str, Any]] = None) -> None:
    """Write the three files into ``directory`` (rank 0 only; Ray then uploads it).
    ``stateful``: more objects with state_dict() (LR schedule, gradient scaler)."""
    torch.save(_to_cpu(model.state_dict()), os.path.join(directory, MODEL_FILE))
    torch.save(
        {
            "optimizer": _to_cpu(optimizer.state_dict()),
            "epoch": state.epoch,
            "step": state.step,
            "rng": state.rng,
            "config": config,
            "saved_by_rank": rank,
            **{name: _to_cpu(obj.state_dict()) for name, obj in (stateful or {}).items()},
        },
        os.path.join(directory, STATE_FILE),
    )
    meta = {"epoch": state.epoch, "step": state.step, "world_size": len(state.rng),
            "saved_by_rank": rank, "time": time.time(), "config": config,
            "files": {name: _fingerprint(os.path.join(directory, name))
                      for name in (MODEL_FILE, STATE_FILE)}}
    with open(os.path.join(directory, META_FILE), "w") as f:
        json.dump(meta, f)


class CheckpointError(RuntimeError):
    """A checkpoint that must not be loaded: cut short, corrupt, or holding pickled code."""


def _fingerprint(path: str) -> dict[str, int]:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return {"bytes": os.path.getsize(path), "crc32": crc}


def verify_checkpoint(directory: str) -> Optional[str]:
    """None if the local checkpoint folder is whole, else what is wrong with it."""
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
        got = _fingerprint(path)
        if got["bytes"] != want["bytes"]:
            return f"{name} has {got['bytes']} bytes, {want['bytes']} were written"
        if got["crc32"] != want["crc32"]:
            return f"{name} is corrupt (CRC-32 mismatch)"
    return None


def _load_tensors(path: str) -> Any:
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
    weights = _load_tensors(os.path.join(directory, MODEL_FILE))
    model.load_state_dict(weights)
    saved = _load_tensors(os.path.join(directory, STATE_FILE))
    optimizer.load_state_dict(saved["optimizer"])
    for name, obj in (stateful or {}).items():
        if name in saved:
            obj.load_state_dict(saved[name])
    return TrainState(epoch=saved["epoch"], step=saved["step"], rng=saved["rng"])


@dataclass
class CheckpointScan:
    """The checkpoints of a run folder, newest first: the first whole one, and the broken."""

    latest: Optional[str] = None
    meta: Optional[dict[str, Any]] = None
    broken: list[tuple[str, str]] = field(default_factory=list)  # (folder, what is wrong)


def find_latest_checkpoint(fs, run_path: str) -> CheckpointScan:
    """Scan ``step-*`` folders newest first; the first whose files match its meta.json wins.

    Only sizes are compared here (no download); workers also check CRC-32 before loading.
    """
    from pyarrow.fs import FileSelector, FileType

    scan = CheckpointScan()
    try:
        infos = fs.get_file_info(FileSelector(run_path, allow_not_found=True))
    except (FileNotFoundError, OSError):
        return scan
    names = sorted(
        (i.base_name for i in infos if i.type == FileType.Directory and i.base_name.startswith("step-")),
        reverse=True,
    )
    for name in names:
        meta = read_json(fs, f"{run_path}/{name}/{META_FILE}")
        problem = _size_problem(fs, f"{run_path}/{name}", meta)
        if problem is None:
            scan.latest, scan.meta = name, meta
            return scan
        scan.broken.append((name, problem))
    return scan


def _size_problem(fs, path: str, meta: Optional[dict[str, Any]]) -> Optional[str]:
    from pyarrow.fs import FileType

    if meta is None or not isinstance(meta.get("files"), dict):
        return f"{META_FILE} is missing or unreadable (a write that never finished)"
    for name, want in meta["files"].items():
        info = fs.get_file_info(f"{path}/{name}")
        if info.type != FileType.File:
            return f"{name} is missing"
        if info.size != want["bytes"]:
            return f"{name} has {info.size} bytes, {want['bytes']} were written"
    return None


def weights_hash(model: nn.Module) -> int:
    """A 48-bit fingerprint of the weights: equal on every rank iff DDP kept them in sync."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return int(h.hexdigest()[:12], 16)  # 48 bits: exact as a float64 metric
