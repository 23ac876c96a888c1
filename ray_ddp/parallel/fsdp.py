"""FSDP2: sharding a model's parameters, gradients and optimizer state across the ranks.

``shard_model`` runs on a worker: each unit the wrap rule picks is wrapped with
``fully_shard``, then the whole model (what is left: embeddings, a final norm, a head),
as torchtitan does. Each rank then holds 1/world of every parameter (a DTensor); a unit's
forward all-gathers its parameters and frees them again, its backward reduce-scatters
the gradients. ``check_fsdp_wrap`` runs on the driver, on the model built on the meta
device, so a wrap rule that names no module fails in one line before Ray starts.

The wrap rule (``--fsdp-wrap``): the named classes; by default each ``Block`` of the
built-in gpt, and for any other model every direct child holding parameters. A parameter
shared by two children (tied embeddings) stays with the root: FSDP2 cannot shard one
parameter in two units.

"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from ray_ddp.checkpoint.sharded import ShardedCheckpointWriter, load_sharded_checkpoint
from ray_ddp.config.train import TrainConfig
from ray_ddp.parallel.materialize import receive_from_rank0
from ray_ddp.parallel.strategy import Strategy, no_context
from ray_ddp.parallel.units import shard_units


class FSDPStrategy(Strategy):
    """FSDP2: the whole model built in host memory by rank 0 only (the others build it on
    the meta device and receive their shards of rank 0's weights), then only this rank's
    shards go to the GPU; every rank writes its own shards; FSDP's mixed precision casts the parameters
    itself, so no autocast runs on top of it."""

    name = "fsdp"
    forward_is_collective = True
    checkpoint_format = "sharded"

    def build_devices(self, devices: Sequence[torch.device]) -> list[torch.device]:
        return [torch.device("cpu")]

    def setup_module(self, model: nn.Module, devices: Sequence[torch.device], from_rank0: bool = False) -> nn.Module:
        import torch.distributed as dist

        # rank 0's whole weights, held by this dict while sharding replaces the parameters
        full = model.state_dict() if from_rank0 and dist.get_rank() == 0 else None
        # before the optimizer: it holds the shards
        sharded = shard_model(model, self.cfg, devices[0], self.mesh(devices[0]))
        if from_rank0:
            collective = devices[0] if dist.get_backend() == "nccl" else torch.device("cpu")
            receive_from_rank0(sharded, full, devices[0], collective)
        return sharded

    def mesh(self, device: torch.device):
        """The ranks the model is sharded over: all of them."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device.type, (dist.get_world_size(),))

    def no_backward_sync(self, wrapped: nn.Module, sync: bool):
        wrapped.set_requires_gradient_sync(sync)
        return no_context()

    def autocast_dtype(self) -> Optional[torch.dtype]:
        return None

    def checkpoint_writer(self, session, rank: int) -> ShardedCheckpointWriter:
        return ShardedCheckpointWriter(session.fs, session.checkpoint_path, rank)

    def load_checkpoint(self, directory, model, optimizer, stateful):
        return load_sharded_checkpoint(directory, model, optimizer, stateful)  # each rank its own shards


def shard_model(model: nn.Module, cfg: TrainConfig, device: torch.device, mesh=None) -> nn.Module:
    """Shard ``model`` (built whole on the CPU, or on the meta device on a rank that
    receives rank 0's weights next) across ``mesh`` (default: every rank; a 2-D mesh of
    replicas x shards is HSDP); the shards move to ``device``. With ``--amp bf16``
    parameters are gathered in bf16 and gradients reduced in fp32 (FSDP2's
    MixedPrecisionPolicy, instead of autocast); the model's output is fp32, for the loss."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = mesh if mesh is not None else FSDPStrategy(cfg).mesh(device)
    policy, root_policy = MixedPrecisionPolicy(), MixedPrecisionPolicy()
    if cfg.amp == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        root_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                           output_dtype=torch.float32)
    for unit in shard_units(model, cfg):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=root_policy)
    return model
