"""DDP: the bare model wrapped for this worker's devices, gradients reduced in backward,
rank 0 writing the whole checkpoint. Runs on workers."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ray_ddp.checkpoint.load import load_checkpoint
from ray_ddp.checkpoint.writer import CheckpointWriter
from ray_ddp.parallel.materialize import make_room
from ray_ddp.parallel.strategy import Strategy, no_context


class DDPStrategy(Strategy):
    name = "ddp"

    def setup_module(self, model: nn.Module, devices: Sequence[torch.device], from_rank0: bool = False) -> nn.Module:
        cfg = self.cfg
        if from_rank0:  # DDP's constructor broadcasts rank 0's parameters and buffers into this memory
            make_room(model, devices[0])
        return wrap_ddp(model, devices, cfg.find_unused_parameters, bucket_view=not cfg.plain_ddp,
                        static_graph=cfg.static_graph, bucket_mb=cfg.bucket_mb)

    def no_backward_sync(self, wrapped: nn.Module, sync: bool):
        return no_context() if sync else wrapped.no_sync()

    def checkpoint_writer(self, session, rank: int) -> Optional[CheckpointWriter]:
        if rank != 0:
            return None  # rank 0 saves the whole state
        return CheckpointWriter(session.fs, session.checkpoint_path)

    def load_checkpoint(self, directory, model, optimizer, stateful):
        return load_checkpoint(directory, model, optimizer, stateful)  # the whole model, on every rank


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
    for the loop's own optimizers, clipping and scaler, which update gradients in place,
    never replace them. ``static_graph`` and ``bucket_mb`` are DDP's own
    ``static_graph`` and ``bucket_cap_mb``; None keeps DDP's default.
    """
    options = dict(find_unused_parameters=find_unused_parameters, gradient_as_bucket_view=bucket_view,
                   static_graph=static_graph)
    if bucket_mb is not None:
        options["bucket_cap_mb"] = bucket_mb
    distinct = {d for d in devices}
    if len(distinct) == 1 and devices[0].type == "cuda":
        return DDP(model, device_ids=[devices[0]], output_device=devices[0], **options)
    return DDP(model, device_ids=None, output_device=None, **options)
