"""HSDP: FSDP2 within a shard group, the groups replicas of each other (torchtitan's
dp_replicate x dp_shard). Parameters are gathered and gradients reduce-scattered within
a group, which by default is the ranks of one node (its fast links), and the gradient
shards are then all-reduced across the replicas: memory per rank is a group's share, not
the world's, and only one all-reduce of 1/group of the gradients crosses the nodes. Runs
on workers.

The shard group (``--fsdp-shard-size N``, default the ranks of a node) is each run of N
consecutive ranks; Ray Train numbers the ranks of a node consecutively. Checkpoints are
FSDP's (DCP): they load under fsdp and hsdp at any world size.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional

import torch

from ray_ddp.errors import ConfigError
from ray_ddp.parallel.fsdp import FSDPStrategy


class HSDPStrategy(FSDPStrategy):
    name = "hsdp"

    def __init__(self, cfg, node_id: Optional[Any] = None):
        super().__init__(cfg)
        self.node_id = node_id  # where this rank runs: the default group is its node's ranks

    def mesh(self, device: torch.device):
        """(replicas, shard group size): a 2-D mesh whose second dimension shards."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        nodes: list = [None] * world
        dist.all_gather_object(nodes, self.node_id)
        size = shard_group_size(self.cfg.fsdp_shard_size, nodes)
        return init_device_mesh(device.type, (world // size, size), mesh_dim_names=("replicate", "shard"))


def shard_group_size(given: Optional[int], nodes: list) -> int:
    """The shard group's size: ``given``, or the ranks of a node (``nodes``: each rank's
    node), which every node must then hold as many of; it divides the world."""
    world = len(nodes)
    if given is None:
        per_node = sorted(set(Counter(nodes).values()))
        if len(per_node) > 1:
            raise ConfigError(f"--strategy hsdp shards within a node by default, but the nodes hold "
                              f"{' and '.join(map(str, per_node))} ranks; give --fsdp-shard-size N "
                              f"(a divisor of the {world} ranks)")
        given = per_node[0]
    if world % given:
        raise ConfigError(f"--fsdp-shard-size {given} does not divide the {world} ranks; give a divisor "
                          f"of {world}")
    return given
