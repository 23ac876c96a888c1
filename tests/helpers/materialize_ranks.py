"""What each rank builds (run in dist_matrix.run_on_ranks' gloo processes): ray_ddp's own
build of a run's first weights (worker/parts.py build_model_on_ranks) under a strategy,
and what it left: the whole weights and buffers, which parameters are one, how far the
process's peak memory rose, and on which device the model's code built it."""

from __future__ import annotations

import os
import resource

import torch
from ray_ddp.driver.resolve import resolve
from torch import nn


def build_cases(rank: int, world: int, cases: list) -> list[dict]:
    """build_on_rank of each (model, strategy, init_from, dims) in turn."""
    return [build_on_rank(model, strategy, init_from, **dims) for model, strategy, init_from, dims in cases]


def build_on_rank(model: str, strategy: str, init_from=None, **dims) -> dict:
    from ray_ddp.config.train import TrainConfig
    from ray_ddp.parallel.build import build_strategy
    from ray_ddp.worker.parts import build_model_on_ranks

    cfg = TrainConfig(model=model, strategy=strategy, seed=3, **dims)
    before = _peak_mb()
    bare, _ = build_model_on_ranks(resolve(cfg, None), build_strategy(cfg), [torch.device("cpu")], None, init_from)
    grew = _peak_mb() - before
    return {"weights": {n: _whole(p) for n, p in bare.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in bare.named_buffers()},
            "parameters": len(list(bare.parameters())),
            "grew_mb": grew,
            "built_on": BUILT_ON[-1] if BUILT_ON else None}


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _whole(p: torch.Tensor) -> torch.Tensor:
    full = getattr(p, "full_tensor", None)  # FSDP's shards, gathered
    return (full() if full is not None else p).detach().clone()


BUILT_ON: list[str] = []


class Noted(nn.Module):
    """A user's model (``--model materialize_ranks:Noted``) that notes the device its code
    built it on, and keeps a buffer computed in ``__init__`` out of its state_dict."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.norm = nn.BatchNorm1d(8)
        self.register_buffer("scale", torch.arange(8, dtype=torch.float32) / 8 + 0.5, persistent=False)
        BUILT_ON.append(str(self.body[0].weight.device))

    def forward(self, x):
        return self.norm(self.body(x)) * self.scale


def write_hf(folder: str, kind: str) -> str:
    """A tiny Hugging Face model saved with save_pretrained (random weights, seed 0)."""
    from hf_tiny import tiny

    path = os.path.join(folder, kind)
    tiny(kind).save_pretrained(path)
    return path
