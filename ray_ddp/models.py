"""The models ray_ddp can train, and how a model name becomes an nn.Module.

Runs on the driver (to refuse a bad model before any worker starts, built on the meta
device so no memory is spent) and on each worker (to build the real model on its
devices). ToyModel and ToyMpModel are the PyTorch DDP tutorial's networks.
"""

from __future__ import annotations

import importlib
from typing import Callable, Sequence

import torch
from torch import nn

from .config import ConfigError, TrainConfig


class ToyModel(nn.Module):
    """The tutorial's network: Linear(in, 10) -> ReLU -> Linear(10, out)."""

    def __init__(self, input_dim: int = 10, output_dim: int = 5, hidden: int = 10):
        super().__init__()
        self.net1 = nn.Linear(input_dim, hidden)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(hidden, output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


class ToyMpModel(nn.Module):
    """ToyModel split in two stages: stage 1 on ``dev0``, stage 2 on ``dev1``.

    Parameter names match ToyModel's, so a checkpoint of one loads into the other.
    Activations hop from dev0 to dev1 in forward; the output lives on dev1.
    """

    def __init__(self, dev0: torch.device, dev1: torch.device, input_dim: int = 10,
                 output_dim: int = 5, hidden: int = 10):
        super().__init__()
        self.dev0, self.dev1 = torch.device(dev0), torch.device(dev1)
        self.net1 = nn.Linear(input_dim, hidden).to(self.dev0)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(hidden, output_dim).to(self.dev1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.net1(x.to(self.dev0)))
        return self.net2(x.to(self.dev1))


def build_mlp(input_dim: int, output_dim: int, width: int, depth: int) -> nn.Sequential:
    """A plain MLP: ``depth`` hidden layers of ``width`` units with GELU."""
    layers: list[nn.Module] = []
    dim = input_dim
    for _ in range(depth):
        layers += [nn.Linear(dim, width), nn.GELU()]
        dim = width
    layers.append(nn.Linear(dim, output_dim))
    return nn.Sequential(*layers)


def load_callable(spec: str, what: str = "model") -> Callable[..., nn.Module]:
    """Resolve ``package.module:callable``; raise ConfigError with the reason if it fails."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{what} '{spec}' must look like package.module:callable")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # any import-time failure of user code is the user's to fix
        raise ConfigError(
            f"{what} '{spec}': cannot import {module_name} ({type(err).__name__}: {err}); "
            "check the module is on PYTHONPATH"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ConfigError(f"{what} '{spec}': {module_name} has no callable named {attr}")
    return fn


def build_model(cfg: TrainConfig, devices: Sequence[torch.device]) -> nn.Module:
    """Build cfg.model on ``devices`` (one device, or a pair for toy-mp)."""
    first, last = devices[0], devices[-1]
    if cfg.model == "toy":
        return ToyModel(cfg.input_dim, cfg.output_dim).to(first)
    if cfg.model == "toy-mp":
        return ToyMpModel(first, last, cfg.input_dim, cfg.output_dim)
    if cfg.model == "mlp":
        return build_mlp(cfg.input_dim, cfg.output_dim, cfg.width, cfg.depth).to(first)
    fn = load_callable(cfg.model)
    try:
        model = fn()
    except Exception as err:
        raise ConfigError(f"model '{cfg.model}' raised {type(err).__name__}: {err}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model '{cfg.model}' returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model.to(first)


def model_stages(name: str) -> int:
    """How many devices the model wants: 2 for the two-stage toy-mp, else 1."""
    return 2 if name == "toy-mp" else 1


def check_model(cfg: TrainConfig) -> int:
    """Build the model on the meta device and refuse one DDP cannot train.

    Returns the number of trainable parameters. Runs on the driver, before Ray starts.
    """
    meta = torch.device("meta")
    with meta:
        model = build_model(cfg, [meta, meta])
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trainable == 0:
        raise ConfigError(
            f"model '{cfg.model}' has no parameter that requires grad, so DDP has nothing to "
            "train; unfreeze at least one parameter"
        )
    return trainable
