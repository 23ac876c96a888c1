"""What FSDP shards as one unit each: the classes ``--fsdp-wrap`` names, the units a model
declares (``fsdp_units()``: the gpt's blocks), the blocks a Hugging Face model names in
``_no_split_modules`` (GPT2Block, LlamaDecoderLayer, T5Block: what transformers itself
keeps whole when it splits a model), or the root's children that own their parameters.
Walks modules only (no process group), so the driver checks it on the meta
device before Ray starts, and workers shard by it."""

from __future__ import annotations

import importlib
from typing import Optional

from torch import nn

from ray_ddp.config.train import TrainConfig
from ray_ddp.errors import ConfigError
from ray_ddp.wrappers import unwrap_peft


def wrap_classes(spec: Optional[str]) -> list:
    """``--fsdp-wrap``'s classes: a dotted name is imported (an nn.Module subclass), a bare
    name is kept as a string, matched against the model's class names."""
    if spec is None:
        return []
    classes = []
    for name in (part.strip() for part in spec.split(",")):
        if not name:
            continue
        if "." not in name:
            classes.append(name)
            continue
        module_name, _, attr = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except Exception as err:  # an import error of the user's package is the user's to fix
            raise ConfigError(f"--fsdp-wrap {name}: cannot import it ({type(err).__name__}: {err})") from None
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ConfigError(f"--fsdp-wrap {name} is not an nn.Module class")
        classes.append(cls)
    return classes


def _matches(module: nn.Module, classes: list) -> bool:
    return any(type(module).__name__ == c if isinstance(c, str) else isinstance(module, c) for c in classes)


def shard_units(model: nn.Module, cfg: TrainConfig) -> list[nn.Module]:
    """The modules sharded as one unit each, before the root, in the model's order."""
    model = unwrap_peft(model)  # under --lora's adapters: the units of the model they adapt
    if cfg.fsdp_wrap is not None:
        return _outermost(model, wrap_classes(cfg.fsdp_wrap))
    declared = getattr(model, "fsdp_units", None)  # a model that names its own (the gpt's blocks)
    if callable(declared):
        return list(declared())
    blocks = getattr(model, "_no_split_modules", None)  # a Hugging Face model's blocks
    alone = _owned_alone(model)
    if blocks:
        # a block holding a weight tied to one outside it (an embedding shared with the
        # head) stays in the root: FSDP cannot shard one parameter in two units
        units = [u for u in _outermost(model, [str(b) for b in blocks]) if alone(u)]
        if units:
            return units
    children = [c for c in model.children() if any(True for _ in c.parameters())]
    return [c for c in children if alone(c)]


def _outermost(model: nn.Module, classes: list) -> list[nn.Module]:
    """The modules of ``classes``, outermost matches only (modules() walks parents first):
    a unit inside another unit would shard twice."""
    units: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if module is not model and id(module) not in inside and _matches(module, classes):
            units.append(module)
            inside.update(id(m) for m in module.modules())
    return units


def _owned_alone(model: nn.Module):
    """A test of whether a module of ``model`` is reached by one path only and every
    parameter under it is held by no module outside that path: tied weights are one
    Parameter held by two modules, or one module held at two places."""
    holders, paths_of = [], {}  # (path, its own parameters' ids); module id -> its paths
    for path, m in model.named_modules(remove_duplicate=False):
        holders.append((path, [id(p) for p in m.parameters(recurse=False)]))
        paths_of.setdefault(id(m), []).append(path)

    def alone(unit: nn.Module) -> bool:
        paths = paths_of.get(id(unit), [])
        if len(paths) != 1:
            return False
        mine = {id(p) for p in unit.parameters()}
        return not any(pid in mine for path, held in holders
                       if path != paths[0] and not path.startswith(paths[0] + ".") for pid in held)
    return alone


def check_fsdp_wrap(cfg: TrainConfig, model: nn.Module) -> int:
    """How many units ``model`` (on the meta device) shards into; a rule naming no module
    of the model is a ConfigError. Runs on the driver."""
    units = shard_units(model, cfg)
    if cfg.fsdp_wrap is not None and not units:
        raise ConfigError(f"--fsdp-wrap {cfg.fsdp_wrap} names no module of model {cfg.model}; "
                          "name a class the model holds (e.g. its transformer block)")
    return len(units)
