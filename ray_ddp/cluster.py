"""The Ray cluster a run uses: attaching to it (or starting a private one), checking it
answers, and the environment workers get. Runs on the driver.

``attach_ray`` tells the caller what it attached to (``ClusterConfig``): the GPUs of each
alive node, and, only for a Ray this call started itself, how many CPUs it has. A Ray
that was already running (a cluster, or a notebook's ``ray.init()``) is shared: its CPUs
are not ours to fill, so CPU workers keep the 1-CPU default there.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from .config import ConfigError, TrainConfig


@dataclass(frozen=True)
class ClusterConfig:
    """What ``attach_ray`` found: GPUs per alive node, and the CPUs of a Ray we started
    (None when the Ray was already there)."""

    node_gpus: list[int]
    own_cpus: Optional[int] = None


@contextmanager
def attach_ray(address: Optional[str], verbose: bool, local_cpus: int = 0) -> Iterator[ClusterConfig]:
    """Attach to Ray (``address``, RAY_ADDRESS, or an already initialized Ray) or start a
    private local one; disconnect (or stop) only what this call connected (or started).
    An explicit ``address`` other than the one a Ray already initialized in this process
    is connected to is refused: Ray cannot attach one process to two clusters."""
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


# FSDP on CPU gathers each unit's parameters (and reduces its gradients) through fresh
# host buffers, layer after layer. glibc raises its mmap threshold to the largest block
# freed so far, so from the second step on these buffers come from the heap, which holds
# on to them: FSDP then peaks above DDP on host memory, the one thing it is for. A fixed
# threshold returns every block of 1 MiB or more on free (benchmarks/fsdp_memory.py
# shows both figures); on GPU the buffers live in CUDA memory and nothing is set. A value
# in the driver's environment wins.
FSDP_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


def worker_runtime_env(cfg: TrainConfig) -> dict[str, Any]:
    """The one place that sets workers' environment: a user model, dataset, loss or
    collate function (``package.module:callable``) must import on the workers as it did
    here; under FSDP on CPU, glibc's mmap threshold is fixed (FSDP_MALLOC_ENV)."""
    specs = [spec for spec in (cfg.model, cfg.dataset, cfg.loss, cfg.collate)
             if spec and ":" in spec and not spec.startswith("python:")]
    env = importable_env(*(spec.split(":")[0] for spec in specs)) if specs else {}
    if cfg.strategy == "fsdp" and not cfg.gpus_per_worker and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        env = {**env, "env_vars": {**env.get("env_vars", {}), **FSDP_MALLOC_ENV}}
    return env


def importable_env(*module_names: str) -> dict[str, Any]:
    """A runtime_env that puts the folder ``module_name`` was imported from on workers'
    PYTHONPATH (Ray does not ship the driver's sys.path). Under ``ray job submit`` the
    job's working_dir is there already; on a multi-node cluster the folder must exist on
    every node, as a shared filesystem or the job's working_dir provides."""
    import importlib

    roots = []
    for module_name in module_names:
        top = module_name.split(".")[0]
        if top == "__main__":
            continue  # cloudpickle ships __main__'s functions by value
        origin = getattr(importlib.import_module(top), "__file__", None)
        if origin is None:
            continue
        root = os.path.dirname(os.path.abspath(origin))
        if os.path.basename(origin) == "__init__.py":
            root = os.path.dirname(root)  # a package: its parent folder goes on the path
        roots.append(root)
    if not roots:
        return {}
    paths = roots + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}}
