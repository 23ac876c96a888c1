"""Loading a DDP checkpoint into the bare model, optimizer and the other stateful
parts, every file ``weights_only``. Runs on workers and in ``ray-ddp export``.
"""

from __future__ import annotations

import os
from typing import Any, Optional
import torch
from torch import nn
from ray_ddp.checkpoint.format import MODEL_FILE, STATE_FILE, TrainState
from ray_ddp.errors import CheckpointError


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
                      epoch_step=saved.get("epoch_step", 0), rows=saved.get("rows", []))
