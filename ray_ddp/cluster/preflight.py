"""Whether the cluster can ever hold the run: slots on the nodes alive now and on the
nodes its autoscaler may launch; waiting for them, or one line saying why not. Runs on
the driver.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Optional
from ray_ddp.errors import ConfigError
from ray_ddp.cluster.placement import Placement


# ------------------------------------------------------------------------ preflight
_HEAD_MARKER = "node:__internal_head__"


UNLIMITED = 1 << 30


def slots_on(resources: dict[str, float], placement: Placement) -> int:
    """How many workers of this placement one node with ``resources`` can hold."""
    fits = int(resources.get("CPU", 0) // placement.cpus_per_worker)
    if placement.use_gpu:
        fits = min(fits, int(resources.get("GPU", 0) // placement.gpus_per_worker))
    return fits


def count_slots(nodes: Iterable[dict[str, float]], placement: Placement) -> int:
    return sum(slots_on(res, placement) for res in nodes)


def autoscaler_slots(head: Optional[dict[str, float]], groups: Iterable[tuple[dict[str, float], int]],
                     placement: Placement) -> int:
    """Slots of the largest cluster the autoscaler may build: the head plus every node
    type at its max count (``max_count`` -1 means unbounded)."""
    total = slots_on(head, placement) if head else 0
    for resources, max_count in groups:
        per_node = slots_on(resources, placement)
        if per_node and max_count < 0:
            return UNLIMITED
        total += per_node * max_count
    return total


def describe_need(placement: Placement) -> str:
    if placement.use_gpu:
        return (f"needs {placement.needed} workers x {placement.gpus_per_worker} GPU = "
                f"{placement.needed * placement.gpus_per_worker} GPU")
    return (f"needs {placement.needed} workers x {placement.cpus_per_worker} CPU = "
            f"{placement.needed * placement.cpus_per_worker} CPU")


def describe_have(nodes: list[dict[str, float]], placement: Placement) -> str:
    key = "GPU" if placement.use_gpu else "CPU"
    total = sum(r.get(key, 0) for r in nodes)
    text = f"the cluster has {total:g} {key}"
    if placement.gpus_per_worker > 1 and total >= placement.needed * placement.gpus_per_worker:
        text += f" but not {placement.gpus_per_worker} on one node for each worker"
    return text


def ensure_cluster_fits(placement: Placement, wait_s: float,
                        echo: Callable[[str], None], poll_s: float = 5.0) -> None:
    """Return once the alive nodes can hold every worker; raise ConfigError if they never
    can, or if the autoscaler has not added what is needed within ``wait_s`` seconds."""
    nodes = _alive_nodes()
    if count_slots(nodes, placement) >= placement.needed:
        return
    need = describe_need(placement)
    groups = _autoscaler_groups()
    if groups is None:
        hint = "; pass --gpus-per-worker 0 to train on CPU" if placement.use_gpu and not any(
            r.get("GPU") for r in nodes) else "; lower --workers or add nodes"
        raise ConfigError(f"{need}; {describe_have(nodes, placement)} and no autoscaler{hint}")
    head = next((r for r in nodes if _HEAD_MARKER in r), None)
    most = autoscaler_slots(head, groups, placement) if groups else UNLIMITED
    if most < placement.needed:
        raise ConfigError(
            f"{need}; {describe_have(nodes, placement)} and its autoscaler can reach at most "
            f"{most} such workers; lower --workers or raise max_workers in the cluster config"
        )
    wait_for_autoscaler(placement, need, wait_s, echo, poll_s)


def ensure_cpu_for_ray_data(placement: Placement) -> None:
    """Raise ConfigError (one line) if Ray Data would get no CPU: Ray Train keeps the
    workers' resources from Ray Data, whose read and map tasks run beside the workers, so
    on a cluster whose CPUs the workers take all of they wait forever without a word. An
    autoscaler may add a node for them: then it is left to do so."""
    nodes = _alive_nodes()
    total = sum(r.get("CPU", 0) for r in nodes)
    workers = min(placement.workers, count_slots(nodes, placement))  # an elastic run takes what fits
    taken = workers * placement.cpus_per_worker
    if total - taken >= 1 or _autoscaler_groups() is not None:
        return
    raise ConfigError(f"Ray Data reads and transforms the data in tasks beside the workers, but the {workers} "
                      f"workers x {placement.cpus_per_worker} CPU take all {total:g} CPU of the cluster: "
                      "lower --workers or --cpus-per-worker, or add a node")


def wait_for_autoscaler(placement: Placement, need: str, wait_s: float,
                         echo: Callable[[str], None], poll_s: float) -> None:
    from ray.autoscaler.sdk import request_resources

    echo(f"waiting up to {wait_s:g} s for the autoscaler to add nodes: the job {need}")
    request_resources(bundles=[placement.resources_per_worker()] * placement.needed)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        nodes = _alive_nodes()
        if count_slots(nodes, placement) >= placement.needed:
            echo("the cluster now holds every worker; starting")
            return
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
    request_resources(bundles=[])  # withdraw the request: nobody will use those nodes
    raise ConfigError(
        f"gave up after {wait_s:g} s waiting for the autoscaler: the job {need}; "
        f"{describe_have(_alive_nodes(), placement)}; raise --wait-for-resources or check "
        "the autoscaler (ray status)"
    )


def _alive_nodes() -> list[dict[str, float]]:
    import ray

    return [n["Resources"] for n in ray.nodes() if n.get("Alive")]


def _autoscaler_groups() -> Optional[list[tuple[dict[str, float], int]]]:
    """(resources, max_count) of each node type the autoscaler may launch; [] when an
    autoscaler runs but does not publish its node types; None when the cluster has no
    autoscaler (a static cluster, a local Ray)."""
    # Autoscaler v2 publishes its node types to the GCS (Ray Train's own check reads the
    # same record); the v1 monitor only publishes its status, so its reach is unknown.
    # here, not at the top: ray_private.py imports Ray, and this module is imported before Ray
    # is needed (the CLI, ray_ddp.spawn)
    from ray_ddp.cluster.ray_private import autoscaler_node_groups, v1_autoscaler_status

    groups = autoscaler_node_groups()
    if groups is not None:
        return groups
    status = v1_autoscaler_status()
    if status and _v1_launches_nodes(status):
        return []
    return None


def _v1_launches_nodes(status: dict[str, Any]) -> bool:
    """Every Ray head runs the v1 monitor; on a static cluster (or a local Ray) it uses a
    read-only provider that names each node type after the node itself ("node_<id>").
    A launcher-made cluster has the node type names of its cluster config."""
    mapping = (status.get("autoscaler_report") or {}).get("node_type_mapping") or {}
    return any(kind != f"node_{node}" for node, kind in mapping.items())
