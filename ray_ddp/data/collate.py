"""Collate functions a user names with ``--collate`` (or ``collate=`` in YAML). Runs on
workers.

``pad_sequences`` batches token sequences of different lengths, as the Hugging Face
models take them: each item is ``(inputs, target)``, inputs a 1-D tensor of token ids or
a dict of them (``input_ids``, ``attention_mask``, ``labels``, ...); every sequence is
padded to the batch's longest: token ids with 0, ``attention_mask`` with 0 (made where an
item has none, 1 over its tokens), ``labels`` and token targets with -100 so they count
for nothing in the loss. A target of one value per item (a class label) is stacked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

IGNORE_INDEX = -100
_PAD = {"attention_mask": 0, "labels": IGNORE_INDEX, "token_type_ids": 0}


def pad_sequences(items: Sequence[tuple[Any, Any]]) -> tuple[Any, Any]:
    inputs = [torch.as_tensor(x) if not isinstance(x, Mapping) else x for x, _ in items]
    targets = [torch.as_tensor(y) for _, y in items]
    if isinstance(inputs[0], Mapping):
        keys = list(inputs[0])
        batch = {k: _pad([torch.as_tensor(x[k]) for x in inputs], _PAD.get(k, 0)) for k in keys}
        if "attention_mask" not in batch and "input_ids" in batch:
            batch["attention_mask"] = _pad([torch.ones(len(torch.as_tensor(x["input_ids"])), dtype=torch.long)
                                            for x in inputs], 0)
    else:
        batch = _pad(inputs, 0)
    target = torch.stack(targets) if targets[0].dim() == 0 else _pad(targets, IGNORE_INDEX)
    return batch, target


def _pad(rows: list[torch.Tensor], value: int) -> torch.Tensor:
    if rows[0].dim() == 0:
        return torch.stack(rows)
    return pad_sequence(rows, batch_first=True, padding_value=value)
