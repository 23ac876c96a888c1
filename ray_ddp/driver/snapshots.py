"""The run's in-memory snapshots dropped at its end, on every node they may be on (the
snapshots themselves: checkpoint/snapshots.py). Runs on the driver.
"""

from __future__ import annotations

from ray_ddp.checkpoint.snapshots import drop_node_snapshots


def drop_snapshots(storage: str, name: str) -> None:
    """Remove the run's snapshots from the driver's node, then, through a task pinned to
    each other live node (no CPU asked), from theirs: they are the nodes' memory. Waits
    at most 30 s; a node that does not answer keeps its folder until it restarts."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    drop_node_snapshots(storage, name)
    here = ray.get_runtime_context().get_node_id()
    others = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != here]
    if not others:
        return
    task = ray.remote(num_cpus=0)(drop_node_snapshots)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(storage, name)
            for node in others]
    ray.wait(refs, num_returns=len(refs), timeout=30)
