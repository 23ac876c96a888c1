"""The Ray cluster a run uses: attaching to it (or starting a private one), checking it
answers, and whether it can ever hold the job (the preflight). Runs on the driver.

``attach_ray`` tells the caller what it attached to (``ClusterConfig``): the GPUs of each
alive node, and, only for a Ray this call started itself, how many CPUs it has. A Ray
that was already running (a cluster, or a notebook's ``ray.init()``) is shared: its CPUs
are not ours to fill, so CPU workers keep the 1-CPU default there.

The preflight (``ensure_cluster_fits``): Ray Train waits forever for workers that cannot
be placed on a static cluster, so the driver checks first. It counts worker *slots* (a
worker needs its CPUs and all of its GPUs on one node) on the alive nodes, and on what
the autoscaler may add (its node types and their max counts, as the autoscaler
publishes them to the GCS), for the workers the run cannot start without (an elastic
run's MIN):
- fits now: go;
- can never fit: one line with the numbers, exit 2, within seconds;
- could fit once the autoscaler adds nodes: ask it for them and wait, at most
  ``--wait-for-resources`` seconds, saying what for.
The slot arithmetic is pure (``count_slots``, ``autoscaler_slots``) and unit-tested.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

from .config import ConfigError
from .devices import PlacementConfig


@dataclass(frozen=True)
class ClusterConfig:
    """What ``attach_ray`` found: GPUs per alive node, and the CPUs of a Ray we started
    (None when the Ray was already there)."""

    node_gpus: list[int]
    own_cpus: Optional[int] = None


@contextmanager
def attach_ray(address: Optional[str], verbose: bool, local_cpus: int = 0,
               idle_workers: bool = True) -> Iterator[ClusterConfig]:
    """Attach to Ray (``address``, RAY_ADDRESS, or an already initialized Ray) or start a
    private local one; disconnect (or stop) only what this call connected (or started).
    An explicit ``address`` other than the one a Ray already initialized in this process
    is connected to is refused: Ray cannot attach one process to two clusters.
    ``idle_workers=False``: a private Ray does not prestart idle Python workers for this
    driver, for a caller that would never use them (see driver.run)."""
    if address is not None:
        check_reachable(address)  # an explicit address is checked even if Ray is up here
    address = address or os.environ.get("RAY_ADDRESS")
    if address is None and "ray" not in sys.modules:
        # A private single-node Ray listens on loopback only, as Ray does on a laptop
        # (macOS); Ray reads this when it is imported, so only before that.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    started_here = False
    own_cpus = None
    if ray.is_initialized():
        _check_same_cluster(address)
    else:
        kwargs: dict[str, Any] = dict(
            log_to_driver=verbose,
            logging_level=logging.INFO if verbose else logging.ERROR,
        )
        if address is None:
            # as many CPU slots as workers asked for, so a local run never waits
            kwargs.update(num_cpus=max(os.cpu_count() or 1, local_cpus), include_dashboard=False)
            if not idle_workers and "RAY_prestart_worker_first_driver" not in os.environ:  # yours wins
                kwargs["_system_config"] = {"prestart_worker_first_driver": False}
            address = "local"
        else:
            check_reachable(address)  # RAY_ADDRESS: fail in seconds, not minutes
        try:
            ray.init(address=address, **kwargs)
        except (ConnectionError, RuntimeError, ValueError) as err:
            if address == "local":
                raise
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(
                f"cannot attach to the Ray cluster at {address} ({first}); start one with "
                "`ray start --head`, fix --address / RAY_ADDRESS, or unset both to run locally"
            ) from None
        started_here = True
        if address == "local":
            own_cpus = int(ray.cluster_resources().get("CPU", 0)) or None
    try:
        yield ClusterConfig([int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")],
                            own_cpus)
    finally:
        if started_here:
            ray.shutdown()


def _check_same_cluster(address: Optional[str]) -> None:
    """Ray is already initialized here: an address naming another cluster cannot be honoured."""
    import ray

    if address is None or address == "auto" or address.startswith("ray://"):
        return
    current = ray.get_runtime_context().gcs_address
    if _host_port(address) != _host_port(current):
        raise ConfigError(
            f"Ray is already initialized in this process (cluster at {current}), so --address / "
            f"RAY_ADDRESS {address} cannot be used; call ray.shutdown() first, or drop the address "
            "to train on the Ray this process is attached to"
        )


def _host_port(address: str) -> tuple[str, str]:
    import socket

    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        host = socket.gethostbyname(host)
    except OSError:
        pass
    return host, port


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds, not minutes, on a cluster that is not there: ray.init retries a
    dead GCS address for a long time before it gives up."""
    import socket

    if address.startswith(("http://", "https://")):
        raise ConfigError(
            f"--address / RAY_ADDRESS is {address}, a dashboard (job server) address; "
            "ray-ddp attaches to the cluster's GCS address (HOST:6379) or 'auto'"
        )
    if address.startswith("ray://"):
        return  # Ray Client: its own connection handling
    gcs = address
    if address == "auto":
        from ray._private.services import canonicalize_bootstrap_address

        try:
            gcs = canonicalize_bootstrap_address("auto")
        except (ConnectionError, RuntimeError, ValueError):
            gcs = None
        if not gcs:
            raise ConfigError("--address auto found no running Ray cluster on this machine; "
                              "start one with `ray start --head` or drop --address")
    host, _, port = gcs.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError):
        raise ConfigError(
            f"no Ray cluster answers at {gcs}; start one with `ray start --head`, "
            "fix --address / RAY_ADDRESS, or unset both to run locally"
        ) from None


def refresh_elastic_view() -> None:
    """Ray Train's elastic policy sizes the worker group from what Ray's
    AutoscalingCoordinator (a cluster-wide actor) reserved for it, and that actor looks
    at the nodes only every 20 s: a run started right after nodes joined would start
    smaller than the cluster, and grow only at the next resize check (60 s later, with a
    restart). Ask it to look now. Its API is internal to Ray: when it is not there, the
    view refreshes by itself."""
    import ray

    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import \
            get_or_create_autoscaling_coordinator

        coordinator = get_or_create_autoscaling_coordinator()
        ray.get(coordinator.get_reserved_resources.remote("ray_ddp", recompute=True), timeout=10)
    except Exception:  # noqa: BLE001 - an optimisation only; Ray refreshes within 20 s anyway
        pass


# ------------------------------------------------------------------------ preflight
_HEAD_MARKER = "node:__internal_head__"
_V1_STATUS_KEY = "__autoscaling_status"  # ray_constants.DEBUG_AUTOSCALING_STATUS
UNLIMITED = 1 << 30


def slots_on(resources: dict[str, float], placement: PlacementConfig) -> int:
    """How many workers of this placement one node with ``resources`` can hold."""
    fits = int(resources.get("CPU", 0) // placement.cpus_per_worker)
    if placement.use_gpu:
        fits = min(fits, int(resources.get("GPU", 0) // placement.gpus_per_worker))
    return fits


def count_slots(nodes: Iterable[dict[str, float]], placement: PlacementConfig) -> int:
    return sum(slots_on(res, placement) for res in nodes)


def autoscaler_slots(head: Optional[dict[str, float]], groups: Iterable[tuple[dict[str, float], int]],
                     placement: PlacementConfig) -> int:
    """Slots of the largest cluster the autoscaler may build: the head plus every node
    type at its max count (``max_count`` -1 means unbounded)."""
    total = slots_on(head, placement) if head else 0
    for resources, max_count in groups:
        per_node = slots_on(resources, placement)
        if per_node and max_count < 0:
            return UNLIMITED
        total += per_node * max_count
    return total


def describe_need(placement: PlacementConfig) -> str:
    if placement.use_gpu:
        return (f"needs {placement.needed} workers x {placement.gpus_per_worker} GPU = "
                f"{placement.needed * placement.gpus_per_worker} GPU")
    return (f"needs {placement.needed} workers x {placement.cpus_per_worker} CPU = "
            f"{placement.needed * placement.cpus_per_worker} CPU")


def describe_have(nodes: list[dict[str, float]], placement: PlacementConfig) -> str:
    key = "GPU" if placement.use_gpu else "CPU"
    total = sum(r.get(key, 0) for r in nodes)
    text = f"the cluster has {total:g} {key}"
    if placement.gpus_per_worker > 1 and total >= placement.needed * placement.gpus_per_worker:
        text += f" but not {placement.gpus_per_worker} on one node for each worker"
    return text


def ensure_cluster_fits(placement: PlacementConfig, wait_s: float,
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


def wait_for_autoscaler(placement: PlacementConfig, need: str, wait_s: float,
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
    from ray._private.state import state
    from ray.experimental.internal_kv import _internal_kv_get

    config: Any = state.get_cluster_config()
    if config is not None and config.node_group_configs:
        return [(dict(g.resources), int(g.max_count)) for g in config.node_group_configs]
    status = _internal_kv_get(_V1_STATUS_KEY)
    if status and _v1_launches_nodes(json.loads(status)):
        return []
    return None


def _v1_launches_nodes(status: dict[str, Any]) -> bool:
    """Every Ray head runs the v1 monitor; on a static cluster (or a local Ray) it uses a
    read-only provider that names each node type after the node itself ("node_<id>").
    A launcher-made cluster has the node type names of its cluster config."""
    mapping = (status.get("autoscaler_report") or {}).get("node_type_mapping") or {}
    return any(kind != f"node_{node}" for node, kind in mapping.items())
