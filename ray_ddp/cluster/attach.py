"""Attaching to a Ray cluster (or starting a local one) and what it holds. Runs on the
driver.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional
from ray_ddp.errors import ConfigError

# cluster/ray_private.py is imported in the functions that call it, not at the top: it
# imports Ray, and this module is imported before Ray is needed (the CLI, ray_ddp.spawn).


@dataclass(frozen=True)
class FoundCluster:
    """What ``attach_ray`` found: GPUs per alive node, and the CPUs of a Ray we started
    (None when the Ray was already there)."""

    node_gpus: list[int]
    own_cpus: Optional[int] = None


@contextmanager
def attach_ray(address: Optional[str], verbose: bool, local_cpus: int = 0,
               idle_workers: bool = True) -> Iterator[FoundCluster]:
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
        yield FoundCluster([int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")],
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
        from ray_ddp.cluster.ray_private import auto_address

        try:
            gcs = auto_address()
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
    restart). Ask it to look now. Its API is internal to Ray (cluster/ray_private.py):
    when it is not there, the view refreshes by itself."""
    try:
        from ray_ddp.cluster.ray_private import refresh_autoscaling_coordinator

        refresh_autoscaling_coordinator("ray_ddp", timeout_s=10)
    except Exception:  # noqa: BLE001 - an optimisation only; Ray refreshes within 20 s anyway
        pass
