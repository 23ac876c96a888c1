"""How a batch reaches the device and the model, and what the model's output holds.
Runs on workers (and on the driver's meta-device check).

Batches and outputs are walked as pytrees (torch.utils._pytree), so nested tuples, dicts,
namedtuples and Hugging Face ``ModelOutput``s need no code of their own. torch keeps that
module private (no public pytree in torch 2.13): ray_ddp imports it here alone (the step
and the driver's checks take tree_map from here), and tests/unit/test_pytree.py pins it. The calling
convention is the field's: a dict batch is passed as keyword arguments when the model's
forward names its keys or takes ``**kwargs`` (``model(**batch)``, as the Hugging Face
Trainer does, which also leaves out the keys a forward does not name), whole to a forward
of one argument; a tuple or list is spread over the forward's arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import tree_leaves, tree_map

from ray_ddp.errors import BatchError
from ray_ddp.wrappers import is_peft_model


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of a (nested) batch on ``device`` (non-blocking). Any Mapping counts
    as a dict: a tokenizer's BatchEncoding (a UserDict, a leaf to pytree) is moved too."""
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        batch = {k: to_device(v, device) for k, v in batch.items()}
    return tree_map(lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, batch)


def count_tokens(batch: Any) -> int:
    """The input tokens of a batch as it came from the source (on the host): a 2-D integer
    tensor of token ids, or a dict row's ``input_ids`` (its ``attention_mask`` counting
    only real tokens where there is one); 0 for anything else (not a token task)."""
    if isinstance(batch, Mapping):
        mask, ids = batch.get("attention_mask"), batch.get("input_ids")
        if isinstance(mask, torch.Tensor) and isinstance(ids, torch.Tensor) and mask.shape == ids.shape:
            return int(mask.sum())
        batch = ids
    if isinstance(batch, torch.Tensor) and batch.dim() == 2 and not batch.is_floating_point() \
            and batch.dtype != torch.bool:
        return batch.numel()
    return 0


def batch_rows(batch: Any) -> int:
    """Rows in a batch: the first dimension of its first tensor."""
    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            return len(leaf) if leaf.dim() else 1
    return 0


def first_row(batch: Any) -> Any:
    """The first row of every tensor of a (nested) batch, copied where it is (no device
    sync; a view would keep the whole batch alive): a stand-in for an empty batch."""
    return tree_map(lambda t: t[:1].detach().clone() if isinstance(t, torch.Tensor) and t.dim() else t, batch)


def forward(model: Callable, inputs: Any) -> Any:
    """Call the model on a batch's inputs by the convention above."""
    if isinstance(inputs, Mapping):
        keys = _keywords_for(model, tuple(inputs))
        if keys is not None:
            return model(**{k: inputs[k] for k in keys})
        return model(inputs)
    if isinstance(inputs, (list, tuple)):
        return model(*inputs)
    return model(inputs)


_KEYWORD_CACHE: dict[tuple[type, tuple[str, ...]], Optional[tuple[str, ...]]] = {}


def _keywords_for(model: Callable, keys: tuple[str, ...]) -> Optional[tuple[str, ...]]:
    """The keys of a dict batch that go to the forward as keyword arguments, or None: the
    dict goes whole (decided once per model class and key set: a signature is not read
    every step)."""
    inner = _unwrapped(model)
    cache_key = (type(inner), keys)
    if cache_key not in _KEYWORD_CACHE:
        _KEYWORD_CACHE[cache_key] = _decide_keywords(inner, keys)
    return _KEYWORD_CACHE[cache_key]


def takes_keyword(model: Callable, name: str) -> bool:
    """Whether the model's forward takes ``name`` (``labels``: can it compute its own loss)."""
    params = _parameters(_unwrapped(model))
    return params is not None and any(p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                                      or p.kind == p.VAR_KEYWORD for p in params)


def _parameters(module: Callable) -> Optional[list[inspect.Parameter]]:
    try:
        return list(inspect.signature(getattr(module, "forward", module)).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature
        return None


def _decide_keywords(module: Callable, keys: tuple[str, ...]) -> Optional[tuple[str, ...]]:
    params = _parameters(module)
    if params is None:  # pass the dict whole
        return None
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    any_keyword = any(p.kind == p.VAR_KEYWORD for p in params)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    if names & set(keys) or (any_keyword and not positional):
        # the keys the forward names (all of them to a **kwargs): a column it does not
        # take (a text column, labels for a model that computes no loss) stays out
        return keys if any_keyword else tuple(k for k in keys if k in names)
    if len(positional) <= 1 or any(p.kind == p.VAR_POSITIONAL for p in params):
        return None  # forward(batch): the dict, whole
    raise BatchError(
        f"the batch is a dict of {', '.join(keys)} but {type(module).__name__}.forward takes "
        f"{', '.join(p.name for p in positional)}: name the forward's parameters after the keys "
        "(they are passed as keyword arguments), or take the dict as one argument")


def _unwrapped(model: Callable) -> Callable:
    """The user's module inside DDP's wrapper, torch.compile's, or --lora's adapters (a
    PeftModel's forward takes anything and hands it on)."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif is_peft_model(model):
            model = model.get_base_model()
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # torch.compile
            model = model._orig_mod
        else:
            return model


def logits_of(output: Any) -> Any:
    """The predictions in a model's output: a tensor itself, ``.logits`` /
    ``["logits"]`` of a dict or ModelOutput, else the first element of a tuple or
    namedtuple; None when the output holds no tensor to take."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        value = output.get("logits")
        if value is None:
            value = next((v for k, v in output.items() if k != "loss" and isinstance(v, torch.Tensor)), None)
        return value
    if isinstance(output, (list, tuple)) and output:
        return output[0]
    return getattr(output, "logits", None)


def loss_of(output: Any) -> Optional[torch.Tensor]:
    """The loss a model computed itself (``.loss`` / ``["loss"]``), or None."""
    if isinstance(output, Mapping):
        value = output.get("loss")
    else:
        value = getattr(output, "loss", None)
    return value if isinstance(value, torch.Tensor) else None


def labels_of(inputs: Any) -> Optional[torch.Tensor]:
    """The ``labels`` a dict batch hands the model (from which it computes its own loss)."""
    if isinstance(inputs, Mapping) and isinstance(inputs.get("labels"), torch.Tensor):
        return inputs["labels"]
    return None


def zero_like_graph(output: Any, leave_out: Any = None) -> torch.Tensor:
    """0, still connected to the model's outputs, so DDP's hooks fire (and FSDP's backward
    runs) for a batch that adds nothing; ``leave_out``: the model's own loss, NaN when it
    averaged over nothing (NaN x 0 is NaN)."""
    leaves = [t for t in tree_leaves(output)
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t is not leave_out]
    return sum((t.float().sum() * 0.0 for t in leaves), torch.zeros(()))
