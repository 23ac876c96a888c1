"""A user model for `ray-ddp train --model my_model:build` (run from this folder)."""

from torch import nn


def build() -> nn.Module:
    """Any callable returning an nn.Module works; it must map --input-dim to --output-dim."""
    return nn.Sequential(nn.Linear(10, 64), nn.GELU(), nn.Linear(64, 5))
