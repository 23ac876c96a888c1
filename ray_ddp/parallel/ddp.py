"""DDP: the bare model wrapped for this worker's devices. Runs on workers.
"""

from __future__ import annotations

from typing import Optional, Sequence
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def wrap_ddp(model: nn.Module, devices: Sequence[torch.device], find_unused_parameters: bool = False,
             bucket_view: bool = True, static_graph: bool = False,
             bucket_mb: Optional[float] = None) -> DDP:
    """Wrap the bare model in DDP for this worker's devices.

    One GPU: ``device_ids=[it]``, as Ray's prepare_model would. A model spread over a
    device pair (or any CPU model) must have ``device_ids=None`` and
    ``output_device=None``: DDP then leaves placement to the module itself.
    ``bucket_view``: each parameter's gradient is a view into DDP's all-reduce bucket
    (``gradient_as_bucket_view``), so backward writes it where the all-reduce reads it:
    no copy in and out of the buckets every step, no second gradient-sized buffer. Safe
    for the loop's own optimizers, clipping and scaler, which update gradients in place
    or set them to None, never replace them. ``static_graph`` and ``bucket_mb`` are DDP's
    own ``static_graph`` and ``bucket_cap_mb``; None keeps DDP's default.
    """
    options = dict(find_unused_parameters=find_unused_parameters, gradient_as_bucket_view=bucket_view,
                   static_graph=static_graph)
    if bucket_mb is not None:
        options["bucket_cap_mb"] = bucket_mb
    distinct = {d for d in devices}
    if len(distinct) == 1 and devices[0].type == "cuda":
        return DDP(model, device_ids=[devices[0]], output_device=devices[0], **options)
    return DDP(model, device_ids=None, output_device=None, **options)
