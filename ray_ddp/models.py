"""The models ray_ddp can train, and how a model name becomes an nn.Module.

Runs on the driver (to refuse a bad model before any worker starts, built on the meta
device so no memory is spent) and on each worker (to build the real model on its
devices). ToyModel and ToyMpModel are the PyTorch DDP tutorial's networks.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Sequence

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


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP, each residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, seq, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        q, k, v = (t.view(rows, seq, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(rows, seq, width))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small decoder-only transformer: token and position embeddings, ``depth`` blocks,
    a final LayerNorm, and an output layer that shares the token embedding's weights."""

    def __init__(self, vocab_size: int, width: int, depth: int, heads: int, seq_len: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.tokens.weight  # weight tying
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


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


def build_model(cfg: TrainConfig, devices: Sequence[torch.device], given: Any = None) -> nn.Module:
    """Build cfg.model on ``devices`` (one device, or a pair for toy-mp); ``given``: a
    model the Python API passed (an nn.Module, or a callable returning one)."""
    first, last = devices[0], devices[-1]
    if given is not None:
        model = given if isinstance(given, nn.Module) else given()
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model= returned {type(model).__name__}, not a torch.nn.Module")
        return model.to(first)
    if cfg.model == "gpt":
        return GPT(cfg.vocab_size, cfg.width, cfg.depth, cfg.heads, cfg.seq_len).to(first)
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


def check_model(cfg: TrainConfig, given: Any = None, example: Any = None) -> int:
    """Build the model on the meta device (a model object the Python API passed is looked
    at as it is) and refuse one DDP cannot train; with ``example`` (a batch of the data's
    first item), also one whose output the task cannot pair with the target.

    Returns the number of trainable parameters. Runs on the driver, before Ray starts.
    """
    meta = torch.device("meta")
    if isinstance(given, nn.Module):
        model = given
    else:
        with meta:
            model = build_model(cfg, [meta, meta], given)
    if cfg.strategy == "fsdp":
        from .fsdp import check_fsdp_wrap

        check_fsdp_wrap(cfg, model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trainable == 0:
        raise ConfigError(
            f"model '{cfg.model}' has no parameter that requires grad, so DDP has nothing to "
            "train; unfreeze at least one parameter"
        )
    if example is not None and not isinstance(given, nn.Module):
        check_output_shape(cfg, model, example)
    return trainable


def check_output_shape(cfg: TrainConfig, model: nn.Module, example: Any) -> None:
    """Run the meta-device model on the example batch and ask the task whether its output
    pairs with the target, so a shape mismatch is one line before any worker starts. A
    model that cannot run on the meta device is checked at its first step instead."""
    from torch.utils._pytree import tree_map

    from .tasks import TargetShapeError, build_task, forward

    def to_meta(t):
        return torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t

    x, y = tree_map(to_meta, example)
    try:
        with torch.no_grad():
            out = forward(model, x)
    except Exception:  # noqa: BLE001 - data-dependent code, a custom op: the worker checks
        return
    if cfg.loss is not None or not isinstance(out, torch.Tensor) or not isinstance(y, torch.Tensor):
        return  # the user's loss pairs them itself
    try:
        build_task(cfg.task or "regression", cfg.seq_len).match_target(out, y)
    except TargetShapeError as err:
        raise ConfigError(f"model '{cfg.model}': {err}") from None
