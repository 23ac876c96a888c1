"""A user's map-style Dataset: loaded from ``package.module:callable``, checked, and
batched (its collate, or torch's) into float32 tensors. Runs on the driver and on
workers.
"""

from __future__ import annotations

from typing import Callable, Optional
import torch
from ray_ddp.errors import ConfigError


def rows_fetcher(dataset, collate: Optional[Callable] = None) -> Callable:
    """fetch(indices) -> (inputs, targets) of a map-style Dataset, collated; an empty index
    list gives an empty batch of the right structure (``default_collate([])`` fails)."""
    from torch.utils.data import default_collate

    collate = collate or default_collate
    empty = []

    def fetch(idx: torch.Tensor):
        if len(idx) == 0:
            if not empty:
                empty.append(empty_batch(collate([dataset[0]])))
            x, y = empty[0]
        else:
            x, y = collate([dataset[i] for i in idx.tolist()])
        return as_float32(x), as_float32(y)

    return fetch


def as_float32(batch):
    """float64 tensors (numpy's default) as float32, the models' dtype; the rest as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.float() if batch.dtype == torch.float64 else batch
    if isinstance(batch, dict):
        return {k: as_float32(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(as_float32(v) for v in batch)
    return batch


def empty_batch(batch):
    """The same structure with zero rows: what a rank trains on when its share is empty."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return {k: empty_batch(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(empty_batch(v) for v in batch)
    return batch


def load_user_dataset(spec: str):
    """``package.module:callable`` returning a map-style Dataset of (input, target) pairs."""
    from ray_ddp.models.build import load_callable

    fn = load_callable(spec, what="dataset")
    try:
        ds = fn()
    except Exception as err:
        raise ConfigError(f"dataset '{spec}' raised {type(err).__name__}: {err}") from None
    return check_dataset(ds, f"dataset '{spec}'")


def check_dataset(ds, what: str):
    """Refuse, in one line, what is not a non-empty map-style Dataset of (input, target) pairs."""
    if not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__"):
        raise ConfigError(f"{what} is {type(ds).__name__}, not a map-style Dataset "
                          "(it needs __len__ and __getitem__)")
    if len(ds) == 0:
        raise ConfigError(f"{what} is empty")
    item = ds[0]
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise ConfigError(f"{what}: items must be (input, target) pairs")
    return ds
