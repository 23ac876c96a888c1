"""User-side models for tests of --model package.module:callable."""

import torch
from torch import nn


def small_net() -> nn.Module:
    """A user's own network for the 10 -> 5 synthetic task."""
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 5))


def frozen_net() -> nn.Module:
    """Nothing to train: DDP refuses such a module."""
    net = nn.Linear(10, 5)
    for p in net.parameters():
        p.requires_grad_(False)
    return net


def not_a_module():
    return torch.zeros(3)


def raises():
    raise RuntimeError("weights file missing")
