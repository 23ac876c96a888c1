"""Who builds the model's weights: with more than one rank, rank 0 builds the whole model
(and reads ``--init-from``'s or ``hf:DIR``'s weights), the others build only its shapes on
the meta device and receive rank 0's values from the strategy: DDP's own broadcast at wrap
time, or under FSDP each tensor broadcast in turn, of which a rank keeps its shard. So one
host process, not one per rank, holds the whole model at start (eight ranks of a 7B model
in fp32: 28 GB at start, where every rank building it took 224 GB). Runs on workers.

A model object the Python API passed is whole on every rank already (it came pickled)
and a two-stage model places its own stages: both keep every rank's own build.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ray_ddp.config.train import TrainConfig
from ray_ddp.models.build import model_stages

META = torch.device("meta")


def rank0_builds(cfg: TrainConfig, given: Any, world_size: int) -> bool:
    """Whether only rank 0 builds the weights (the same answer on every rank)."""
    return world_size > 1 and not isinstance(given, nn.Module) and model_stages(cfg.model) == 1


def on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def make_room(model: nn.Module, device: torch.device) -> None:
    """A meta-device model given uninitialized memory on ``device`` (its values come from
    rank 0 next); a model with values is left as it is. A tensor held under two names (a
    head tied to the embedding) is one tensor again after: ``to_empty`` gives each name
    its own, and DDP would then count a parameter more than rank 0 has."""
    if not on_meta(model):
        return
    held = _names_by_tensor(model)
    model.to_empty(device=device)
    for names in held:
        kept = model.get_parameter(names[0]) if _is_parameter(model, names[0]) else model.get_buffer(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            if getattr(module, attr) is kept:
                continue
            if isinstance(kept, nn.Parameter):
                setattr(module, attr, kept)
            else:  # as it was registered: a non-persistent one stays out of the state_dict
                module.register_buffer(attr, kept, persistent=attr not in module._non_persistent_buffers_set)


def _names_by_tensor(model: nn.Module) -> list[list[str]]:
    """The names of each tensor held under more than one."""
    names: dict[int, list[str]] = {}
    for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), []).append(name)
    return [n for n in names.values() if len(n) > 1]


def _is_parameter(model: nn.Module, name: str) -> bool:
    owner, _, attr = name.rpartition(".")
    return attr in model.get_submodule(owner)._parameters


def receive_from_rank0(model: nn.Module, full: Optional[dict], device: torch.device,
                       collective_device: torch.device) -> None:
    """Rank 0's weights into every rank's sharded ``model`` (FSDP2): each tensor of rank 0's
    ``full`` state_dict (None on the others) broadcast in turn, each rank keeping its shard
    (torch's set_model_state_dict with broadcast_from_rank0), so a rank holds its shards and
    one whole tensor at a time. Then every buffer from rank 0, those a state_dict leaves
    out (``persistent=False``: a rotary embedding's frequencies computed in ``__init__``,
    which the meta device never computed) included."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    make_room(model, device)
    set_model_state_dict(model, full if dist.get_rank() == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    broadcast_buffers(model, collective_device)


def broadcast_buffers(model: nn.Module, collective_device: torch.device) -> None:
    """Give every rank rank 0's buffers (a DTensor one is FSDP's, kept alike by FSDP)."""
    for buffer in model.buffers():
        if hasattr(buffer, "to_local"):
            continue
        if buffer.device == collective_device:
            dist.broadcast(buffer, src=0)
        else:  # gloo on CPU for buffers on a GPU
            staged = buffer.to(collective_device)
            dist.broadcast(staged, src=0)
            buffer.copy_(staged)
