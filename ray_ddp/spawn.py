"""Bring your own DDP code: ``ray_ddp.spawn`` in place of ``mp.spawn``, and the engine of
``ray-ddp launch`` for torchrun-style scripts.

Runs on the driver, which places N Ray actors (one GPU, a pair, or a CPU each; one
placement group, so the job starts whole or not at all) and runs the user's code in
them. Each process finds in its environment what ``dist.init_process_group()`` (env://)
needs: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and a free
MASTER_PORT on rank 0's node, where rank 0's actor hosts the rendezvous store for the
group's whole life (as torchrun's agent does). ``ray_ddp.device()`` gives a process its device (Ray sets
CUDA_VISIBLE_DEVICES per process, so it is ``cuda:0``, never ``cuda:<rank>``).
The code in the actors (``_Process``) is the only part that runs on the workers.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .config import ConfigError
from .devices import PlacementConfig


class ProcessFailed(RuntimeError):
    """A spawned process raised or exited non-zero; ``rank`` says which."""

    def __init__(self, rank: int, message: str, exit_code: Optional[int] = None):
        super().__init__(f"process {rank} failed: {message}")
        self.rank, self.exit_code = rank, exit_code


def device(index: int = 0) -> torch.device:
    """This process's device: its (first, or ``index``-th) GPU, else the CPU."""
    return devices()[index] if torch.cuda.is_available() else torch.device("cpu")


def devices() -> list[torch.device]:
    """All GPUs Ray gave this process (two for gpus_per_process=2), or [cpu]."""
    if not torch.cuda.is_available():
        return [torch.device("cpu")]
    return [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class _Process:
    """One rank: an actor that sets the env:// variables, then runs the user's code."""

    def where(self) -> tuple[str, str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), _free_port()

    def host_store(self, port: int, world_size: int) -> None:
        """Host the rendezvous TCPStore for the whole group's life, as torchrun's agent
        does: if rank 0's own process hosted it, a rank still tearing down its process
        group when rank 0 exits would lose the store and abort."""
        from datetime import timedelta

        import torch.distributed as dist

        self._store = dist.TCPStore("0.0.0.0", port, world_size, is_master=True,
                                    timeout=timedelta(minutes=30), wait_for_workers=False)

    def set_env(self, env: dict[str, str]) -> None:
        os.environ.update(env)

    def call(self, fn: Callable[..., Any], rank: int, args: tuple) -> Any:
        return fn(rank, *args)

    def run_script(self, argv: list[str], show_output: bool) -> int:
        """Run an unmodified script as a child process; only rank 0's output is shown."""
        out = None if show_output else subprocess.DEVNULL
        return subprocess.call([sys.executable, *argv], stdout=out, stderr=None if show_output else out)


@dataclass
class _Group:
    actors: list
    placement_group: Any


def _start_group(placement: PlacementConfig, runtime_env: dict) -> _Group:
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = placement.resources_per_worker()
    pg = placement_group([bundle] * placement.workers, strategy="PACK")
    ray.get(pg.ready())
    actor_cls = ray.remote(_Process)
    actors = [
        actor_cls.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), runtime_env=runtime_env,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote()
        for i in range(placement.workers)
    ]
    where = ray.get([a.where.remote() for a in actors])
    master_addr, master_port = where[0][1], where[0][2]
    ray.get(actors[0].host_store.remote(master_port, placement.workers))
    per_node: dict[str, list[int]] = {}
    for rank, (node, _, _) in enumerate(where):
        per_node.setdefault(node, []).append(rank)
    ray.get([
        a.set_env.remote({
            "RANK": str(rank), "WORLD_SIZE": str(placement.workers),
            "LOCAL_RANK": str(per_node[where[rank][0]].index(rank)),
            "LOCAL_WORLD_SIZE": str(len(per_node[where[rank][0]])),
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
            # every rank, rank 0 too, is a client of the store the rank-0 actor hosts
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        })
        for rank, a in enumerate(actors)
    ])
    return _Group(actors, pg)


def _stop_group(group: _Group) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for actor in group.actors:
        ray.kill(actor)
    remove_placement_group(group.placement_group)


def _join(refs: Sequence, check: Optional[Callable[[int, Any], None]] = None) -> list[Any]:
    """Wait for every rank; on the first failure stop waiting and say which rank failed
    (the others may be blocked in a collective with it and would never finish).
    ``check(rank, result)`` may raise ProcessFailed for a result that is a failure."""
    import ray

    pending = list(refs)
    results: dict[int, Any] = {}
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ref = done[0]
        rank = refs.index(ref)
        try:
            results[rank] = ray.get(ref)
        except ray.exceptions.RayTaskError as err:
            cause = err.cause if getattr(err, "cause", None) is not None else err
            raise ProcessFailed(rank, f"{type(cause).__name__}: {cause}") from None
        except ray.exceptions.RayActorError as err:
            raise ProcessFailed(rank, f"the process died ({str(err).splitlines()[0]})") from None
        if check is not None:
            check(rank, results[rank])
    return [results[r] for r in range(len(refs))]


def spawn(fn: Callable[..., Any], args: tuple = (), nprocs: int = 1, gpus_per_process: int = 0,
          address: Optional[str] = None, join: bool = True, max_failures: int = 0) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes placed by Ray, like
    ``torch.multiprocessing.spawn``; returns each rank's return value.

    An exception in any process is re-raised here as ProcessFailed naming the rank.
    ``max_failures``: restart all processes that many times when one fails.
    """
    if not join:
        raise ValueError("ray_ddp.spawn supports join=True only (it waits for every process)")
    from .driver import importable_env

    placement = _placement(nprocs, gpus_per_process)
    return _run_with_restarts(placement, address, max_failures,
                              lambda group: [a.call.remote(fn, rank, tuple(args))
                                             for rank, a in enumerate(group.actors)],
                              runtime_env=importable_env(fn.__module__))


def launch(argv: list[str], nprocs: int, gpus_per_process: int = 0,
           address: Optional[str] = None, max_failures: int = 0) -> int:
    """Run a torchrun-style script in ``nprocs`` processes; returns its exit status
    (rank 0's, or the first failing rank's)."""
    placement = _placement(nprocs, gpus_per_process)
    try:
        codes = _run_with_restarts(placement, address, max_failures,
                                   lambda group: [a.run_script.remote(argv, rank == 0)
                                                  for rank, a in enumerate(group.actors)],
                                   check_exit_codes=True, show_output=True)
    except ProcessFailed as err:
        print(f"ray-ddp launch: {err}", file=sys.stderr)
        code = err.exit_code or 1
        return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as shells say
    return codes[0]


def _placement(nprocs: int, gpus_per_process: int) -> PlacementConfig:
    if nprocs < 1:
        raise ConfigError(f"nprocs must be a positive integer, got {nprocs}")
    if gpus_per_process not in (0, 1, 2):
        raise ConfigError(f"gpus_per_process must be 0, 1 or 2, got {gpus_per_process}")
    return PlacementConfig(workers=nprocs, gpus_per_worker=gpus_per_process, cpus_per_worker=1,
                           backend="nccl" if gpus_per_process else "gloo")


def _exit_code_check(rank: int, code: int) -> None:
    if code != 0:
        raise ProcessFailed(rank, f"exited with status {code}", exit_code=code)


def _run_with_restarts(placement: PlacementConfig, address: Optional[str], max_failures: int,
                       submit: Callable[[_Group], list], check_exit_codes: bool = False,
                       show_output: bool = False, runtime_env: Optional[dict] = None) -> list[Any]:
    from .driver import attach_ray
    from .preflight import ensure_cluster_fits

    with attach_ray(address, verbose=False, local_cpus=placement.workers,
                    show_worker_output=show_output):
        ensure_cluster_fits(placement, wait_s=900, echo=lambda line: print(line, file=sys.stderr))
        attempt = 0
        while True:
            group = _start_group(placement, runtime_env or {})
            try:
                return _join(submit(group), _exit_code_check if check_exit_codes else None)
            except ProcessFailed as err:
                if attempt >= max_failures:
                    raise
                attempt += 1
                print(f"ray_ddp: {err}; restarting all {placement.workers} processes "
                      f"({attempt}/{max_failures})", file=sys.stderr)
            finally:
                _stop_group(group)
