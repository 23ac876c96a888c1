"""A user's map-style Dataset: loaded from ``package.module:callable``, checked, and
batched (its collate, or torch's) into float32 tensors. Runs on the driver and on
workers.

Items come in two conventions: ``(input, target)`` pairs (torch's), or dict rows (the
Hugging Face ``datasets`` convention: ``{"input_ids", "attention_mask", "labels"}``, from a
``datasets.Dataset``, a list of dicts or any Dataset returning dicts). Dict rows are
batched as one dict (a tokenizer's collator takes the list of rows as it is, as the
Hugging Face Trainer hands it); the batch is the model's input and its ``labels`` the
target (``label`` / ``label_ids`` are read as ``labels``, as transformers' collators do).
A batch without labels is its own target: a ``loss=`` gets the model output and the rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional
import torch
from ray_ddp.errors import ConfigError
from ray_ddp.config.callables import load_callable

LABEL_KEYS = ("labels", "label", "label_ids")


def rows_fetcher(dataset, collate: Optional[Callable] = None) -> Callable:
    """fetch(indices) -> (inputs, targets) of a map-style Dataset, collated; an empty index
    list gives an empty batch of the right structure (``default_collate([])`` fails). A
    Dataset with ``__getitems__`` (a ``datasets.Dataset``, a save_to_disk folder's rows)
    is asked for the micro-batch's rows at once, as torch's DataLoader asks it."""
    empty = []
    batched = getattr(dataset, "__getitems__", None)

    def fetch(idx: torch.Tensor):
        if len(idx) == 0:
            if not empty:
                empty.append(empty_batch(collate_items([dataset[0]], collate)))
            return empty[0]
        indices = idx.tolist()
        return collate_items(list(batched(indices)) if batched else [dataset[i] for i in indices], collate)

    return fetch


def collate_items(items: list, collate: Optional[Callable] = None) -> tuple[Any, Any]:
    """(inputs, targets) of a Dataset's items, float64 as float32: pairs through the
    collate (torch's by default), dict rows as one dict batch (module docstring). The
    items say which they are."""
    from torch.utils.data import default_collate

    if not isinstance(items[0], Mapping):
        x, y = (collate or default_collate)(items)
        return as_float32(x), as_float32(y)
    rows = collate(items) if collate is not None else default_collate([as_row(i) for i in items])
    # a BatchEncoding is a UserDict: made a dict, so it is moved to the device as one
    rows = as_float32(with_labels(dict(rows)))
    return rows, rows.get("labels", rows)  # rows without labels are their own target


def is_dict_rows(dataset) -> bool:
    return isinstance(dataset[0], Mapping)


def as_row(item: Mapping) -> dict[str, Any]:
    """A dict row with its numbers and lists of numbers as tensors (a ``datasets`` row
    without ``with_format("torch")`` holds Python lists); other values (text) as they are."""
    row = {}
    for key, value in with_labels(dict(item)).items():
        try:
            row[key] = torch.as_tensor(value) if not isinstance(value, (str, bytes)) else value
        except (TypeError, ValueError, RuntimeError):
            row[key] = value
    return row


def with_labels(row: dict[str, Any]) -> dict[str, Any]:
    """``label`` or ``label_ids`` renamed ``labels``, what Hugging Face models take."""
    for key in LABEL_KEYS[1:]:
        if key in row and "labels" not in row:
            row["labels"] = row.pop(key)
    return row


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
    """``package.module:callable`` returning a map-style Dataset of (input, target) pairs
    or dict rows."""

    fn = load_callable(spec, what="dataset")
    try:
        ds = fn()
    except Exception as err:
        raise ConfigError(f"dataset '{spec}' raised {type(err).__name__}: {err}") from None
    return check_dataset(ds, f"dataset '{spec}'")


def check_dataset(ds, what: str):
    """Refuse, in one line, what is not a non-empty map-style Dataset of (input, target)
    pairs or dict rows; a ``datasets.DatasetDict`` names its splits."""
    if _is_dataset_dict(ds):
        raise ConfigError(f"{what} is a DatasetDict of splits {sorted(ds)}: give one split, "
                          f"e.g. {what.rstrip('=')}=dataset['train']")
    if not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__"):
        raise ConfigError(f"{what} is {type(ds).__name__}, not a map-style Dataset "
                          "(it needs __len__ and __getitem__)")
    if len(ds) == 0:
        raise ConfigError(f"{what} is empty")
    item = ds[0]
    if not (isinstance(item, (tuple, list)) and len(item) == 2 or isinstance(item, Mapping)):
        raise ConfigError(f"{what}: items must be (input, target) pairs or dict rows, "
                          f"not {type(item).__name__}")
    return ds


def _is_dataset_dict(ds) -> bool:
    return type(ds).__name__ in ("DatasetDict", "IterableDatasetDict")
