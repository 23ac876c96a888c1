"""What each process of ``ray_ddp.spawn`` / ``ray-ddp launch`` finds in its environment:
torchrun's variables, and a node's GPUs shared so that ``cuda:LOCAL_RANK`` works.
Computed on the driver.
"""

from __future__ import annotations

from typing import Sequence


# The indices, within CUDA_VISIBLE_DEVICES, of the GPUs a spawned process owns ("0", "2,3"),
# or "" for a process given none. ray_ddp.device() reads it: a process must not guess its
# GPU from torch.cuda.is_available(), which is true for a CPU process on a GPU node (Ray
# leaves a process without GPUs every GPU of its node).
PROCESS_DEVICES_ENV = "RAY_DDP_DEVICES"


def plan_node_env(processes: Sequence[tuple[str, Sequence[str]]]) -> list[dict[str, str]]:
    """The environment of each process, by rank, from ``(node_id, gpu_ids)`` per rank (the
    ids Ray gave it). As Ray Train does, every process on a node sees the GPUs of all of
    them, so unmodified torchrun code (``torch.cuda.set_device(LOCAL_RANK)``) works: a
    node's processes are ordered by their GPUs, and local rank k of ``g`` GPUs each owns
    visible devices k*g .. k*g+g-1. A group without GPUs keeps the visible devices Ray
    gave it and owns none."""
    by_node: dict[str, list[int]] = {}
    for rank, (node, _) in enumerate(processes):
        by_node.setdefault(node, []).append(rank)
    envs: list[dict[str, str]] = [{} for _ in processes]
    for ranks in by_node.values():
        ranks.sort(key=lambda r: (min(map(_gpu_order, processes[r][1]), default=()), r))
        # each process's ids in a row, in local-rank order: for the contiguous ids Ray
        # hands out this is the node's sorted union, and ownership holds whatever the ids
        visible = list(dict.fromkeys(gpu for r in ranks
                                     for gpu in sorted(processes[r][1], key=_gpu_order)))
        for local_rank, rank in enumerate(ranks):
            own = sorted(visible.index(gpu) for gpu in processes[rank][1])
            envs[rank] = {"RANK": str(rank), "WORLD_SIZE": str(len(processes)),
                          "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(len(ranks)),
                          PROCESS_DEVICES_ENV: ",".join(map(str, own))}
            if visible:
                envs[rank]["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
    return envs


def _gpu_order(gpu_id: str) -> tuple:
    """Numeric ids in numeric order ("2" before "10"), then any others (UUIDs) by name."""
    return (0, int(gpu_id), "") if gpu_id.isdigit() else (1, 0, gpu_id)
