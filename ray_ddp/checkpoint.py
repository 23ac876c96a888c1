"""Checkpoint files: what rank 0 writes and what every rank (and the driver) reads back.

A checkpoint is a folder ``step-<global step>`` in the run directory holding
- ``model.pt``: the bare model's ``state_dict`` (CPU tensors, no ``module.`` prefix),
  loadable with ``torch.load(path, weights_only=True)`` without ray_ddp installed;
- ``train_state.pt``: optimizer state, epoch, global step, every rank's RNG state, config;
- ``meta.json``: epoch, step and config in plain JSON, written last, so the driver can
  find the latest checkpoint without loading tensors.
``save_checkpoint`` and ``load_checkpoint`` run on workers; ``find_latest_checkpoint``
on the driver.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
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
                    state: TrainState, config: dict[str, Any], rank: int) -> None:
    """Write the three files into ``directory`` (rank 0 only; Ray then uploads it)."""
    torch.save(_to_cpu(model.state_dict()), os.path.join(directory, MODEL_FILE))
    torch.save(
        {
            "optimizer": _to_cpu(optimizer.state_dict()),
            "epoch": state.epoch,
            "step": state.step,
            "rng": state.rng,
            "config": config,
            "saved_by_rank": rank,
        },
        os.path.join(directory, STATE_FILE),
    )
    meta = {"epoch": state.epoch, "step": state.step, "world_size": len(state.rng), "saved_by_rank": rank,
            "time": time.time(), "config": config}
    with open(os.path.join(directory, META_FILE), "w") as f:
        json.dump(meta, f)


def load_checkpoint(directory: str, model: nn.Module,
                    optimizer: torch.optim.Optimizer) -> TrainState:
    """Load the files of ``directory`` into the bare (not yet DDP-wrapped) model and optimizer."""
    weights = torch.load(os.path.join(directory, MODEL_FILE), map_location="cpu", weights_only=True)
    model.load_state_dict(weights)
    saved = torch.load(os.path.join(directory, STATE_FILE), map_location="cpu", weights_only=True)
    optimizer.load_state_dict(saved["optimizer"])
    return TrainState(epoch=saved["epoch"], step=saved["step"], rng=saved["rng"])


def find_latest_checkpoint(fs, run_path: str) -> Optional[tuple[str, dict[str, Any]]]:
    """The newest complete ``step-*`` folder of a run and its meta, or None."""
    from pyarrow.fs import FileSelector, FileType

    try:
        infos = fs.get_file_info(FileSelector(run_path, allow_not_found=True))
    except (FileNotFoundError, OSError):
        return None
    names = sorted(
        (i.base_name for i in infos if i.type == FileType.Directory and i.base_name.startswith("step-")),
        reverse=True,
    )
    for name in names:
        meta = read_json(fs, f"{run_path}/{name}/{META_FILE}")
        if meta is not None:
            return name, meta
    return None


def weights_hash(model: nn.Module) -> int:
    """A 48-bit fingerprint of the weights: equal on every rank iff DDP kept them in sync."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return int(h.hexdigest()[:12], 16)  # 48 bits: exact as a float64 metric
