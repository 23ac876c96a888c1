"""What a rank checks before it reports or saves: a loss or weights that became NaN or
infinite stop every rank together, and poisoned weights are never checkpointed. Runs on
workers."""

from __future__ import annotations

import torch
from torch import nn

from ray_ddp.errors import NonFiniteLossError


def weights_are_finite(model: nn.Module) -> bool:
    """Whether every floating tensor of the state (weights, BatchNorm statistics) is finite:
    checked before a checkpoint, since the loss is computed before the update that may
    have made them infinite."""
    # FSDP: this rank's shard (agree() ORs the ranks)
    local = [t.to_local() if hasattr(t, "to_local") else t for t in model.state_dict().values()]
    floats = [t.detach() for t in local if t.is_floating_point()]
    per_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in floats:
        # a sum is finite when every term is (a NaN or inf carries into it): one read of
        # the weights, no mask as big as them
        wide = torch.float64 if t.dtype == torch.float64 else torch.float32
        per_device.setdefault(t.device, []).append(t.sum(dtype=wide).isfinite())
    if all(bool(torch.stack(flags).all()) for flags in per_device.values()):  # a sync per device
        return True
    # a non-finite sum: an inf or NaN, or finite values whose sum overflowed; look closer
    return all(bool(torch.isfinite(t).all()) for t in floats)


def raise_if_not_finite(epoch: int, step: int, bad_loss: list[int], bad_weights: list[int]) -> None:
    """Stop every rank (each got the same flags from one all-reduce) in one line."""
    if bad_loss or bad_weights:
        what = "loss" if bad_loss else "weights"
        ranks = bad_loss or bad_weights
        on = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)}"
        raise NonFiniteLossError(
            f"{what} became non-finite (NaN or inf) on {on} in epoch {epoch + 1} by step {step}; "
            "no checkpoint holds them; lower --lr, set --clip-grad, or check the data")
