"""``ray_ddp.spawn``: torch.multiprocessing.spawn's contract on Ray actors, one process
per rank across the cluster, restarted together when one fails. Runs on the driver (the
actors run the user's function).
"""

from __future__ import annotations

import collections
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence
from ray_ddp.errors import ConfigError
from ray_ddp.cluster.placement import Placement
from ray_ddp.launch.env import plan_node_env
from ray_ddp.errors import ProcessFailed
from ray_ddp.cluster.attach import attach_ray
from ray_ddp.cluster.preflight import describe_need, ensure_cluster_fits
from ray_ddp.cluster.runtime_env import importable_env, object_modules


DEFAULT_WAIT_S = 900.0  # as `ray-ddp train --wait-for-resources`


class _Process:
    """One rank: an actor that sets the env:// variables, then runs the user's code. It is
    threaded (two calls at once), so the driver can fetch a script's output while it runs."""

    def where(self) -> tuple[str, str, list[str]]:
        """This actor's node id, node address and the GPU ids Ray gave it. Nothing here
        may touch CUDA: set_env widens CUDA_VISIBLE_DEVICES later, and CUDA reads it once."""
        import ray

        context = ray.get_runtime_context()
        gpus = [str(gpu) for gpu in context.get_accelerator_ids().get("GPU", [])]
        return context.get_node_id(), ray.util.get_node_ip_address(), gpus

    def host_store(self, address: str, world_size: int) -> int:
        """Host the rendezvous TCPStore for the whole group's life, as torchrun's agent
        does (if rank 0's own process hosted it, a rank still tearing down its process
        group when rank 0 exits would lose the store and abort). It listens on this node's
        address only, not on every interface; returns its port."""
        from datetime import timedelta

        import torch.distributed as dist

        self._socket = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
        self._socket.bind((address, 0))
        self._socket.listen(128)
        port = self._socket.getsockname()[1]
        self._store = dist.TCPStore(address, port, world_size, is_master=True,
                                    timeout=timedelta(minutes=30), wait_for_workers=False,
                                    master_listen_fd=self._socket.fileno())
        return port

    def set_env(self, env: dict[str, str]) -> None:
        """Before the user's code runs: a function runs in this process, a script is a child
        that inherits it (Ray resets visible devices only for tasks, not actor calls)."""
        os.environ.update(env)

    def call(self, fn: Callable[..., Any], rank: int, args: tuple) -> Any:
        return fn(rank, *args)

    def run_script(self, argv: list[str]) -> tuple[int, list[str]]:
        """Run an unmodified script as a child process; its stdout and stderr lines are
        kept for ``read_output``. Returns its exit status and the last lines of its stderr
        (a traceback's end, for the error summary)."""
        self._lock = threading.Lock()
        self._lines: list[tuple[str, str]] = []  # (stream, line), in arrival order
        tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
        child = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, errors="replace", bufsize=1)

        def pump(stream, name: str) -> None:
            for line in stream:
                line = line.rstrip("\n")
                with self._lock:
                    self._lines.append((name, line))
                if name == "stderr":
                    tail.append(line)

        readers = [threading.Thread(target=pump, args=(child.stdout, "stdout"), daemon=True),
                   threading.Thread(target=pump, args=(child.stderr, "stderr"), daemon=True)]
        for reader in readers:
            reader.start()
        code = child.wait()
        for reader in readers:
            reader.join()
        return code, list(tail)

    def read_output(self, start: int) -> list[tuple[str, str]]:
        """The script's output lines from index ``start`` on."""
        lock = getattr(self, "_lock", None)
        if lock is None:
            return []
        with lock:
            return self._lines[start:]


TAIL_LINES = 15  # stderr lines of a failed rank shown in the error summary


@dataclass
class GroupState:
    actors: list
    placement_group: Any


def start_group(placement: Placement, runtime_env: dict, wait_s: float) -> GroupState:
    """Reserve every process's resources at once (a placement group), waiting at most
    ``wait_s`` seconds (other work may hold what the preflight saw free), then start the
    actors and rank 0's rendezvous store."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = placement.resources_per_worker()
    pg = placement_group([bundle] * placement.workers, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=wait_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise ConfigError(
            f"could not place the processes within {wait_s:g} s: the job "
            f"{describe_need(placement)}, and the cluster's free resources did not hold it; "
            "free them, lower --workers, or raise --wait-for-resources") from None
    actor_cls = ray.remote(_Process)
    actors = [
        actor_cls.options(
            max_concurrency=2,  # run_script and read_output at once
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), runtime_env=runtime_env,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote()
        for i in range(placement.workers)
    ]
    where = ray.get([a.where.remote() for a in actors])
    master_addr = where[0][1]
    master_port = ray.get(actors[0].host_store.remote(master_addr, placement.workers))
    envs = plan_node_env([(node, gpus) for node, _, gpus in where])
    ray.get([
        a.set_env.remote({
            **env, "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
            # every rank, rank 0 too, is a client of the store the rank-0 actor hosts
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        })
        for a, env in zip(actors, envs)
    ])
    return GroupState(actors, pg)


def _stop_group(group: GroupState) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for actor in group.actors:
        ray.kill(actor)
    remove_placement_group(group.placement_group)


def join_processes(refs: Sequence, check: Optional[Callable[[int, Any], None]] = None,
          on_wait: Optional[Callable[[], None]] = None, poll_s: float = 0.2) -> list[Any]:
    """Wait for every rank; on the first failure stop waiting and say which rank failed
    (the others may be blocked in a collective with it and would never finish).
    ``check(rank, result)`` may raise ProcessFailed for a result that is a failure;
    ``on_wait`` is called every ``poll_s`` seconds while ranks are still running."""
    import ray

    pending = list(refs)
    results: dict[int, Any] = {}
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=poll_s if on_wait else None)
        if not done:
            on_wait()
            continue
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
          address: Optional[str] = None, join: bool = True, max_failures: int = 0,
          wait_for_resources: float = DEFAULT_WAIT_S) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes placed by Ray, like
    ``torch.multiprocessing.spawn``; returns each rank's return value.

    An exception in any process is re-raised here as ProcessFailed naming the rank.
    ``max_failures``: restart all processes that many times when one fails.
    ``wait_for_resources``: seconds to wait for the cluster to hold every process.
    """
    if not join:
        raise ValueError("ray_ddp.spawn supports join=True only (it waits for every process)")

    placement = plan_processes(nprocs, gpus_per_process)
    return run_with_restarts(placement, address, max_failures, wait_for_resources,
                              lambda group: join_processes([a.call.remote(fn, rank, tuple(args))
                                                   for rank, a in enumerate(group.actors)]),
                              runtime_env=importable_env(*object_modules(fn), *(m for a in args for m in object_modules(a))))


def plan_processes(nprocs: int, gpus_per_process: int) -> Placement:
    if nprocs < 1:
        raise ConfigError(f"nprocs must be a positive integer, got {nprocs}")
    if gpus_per_process not in (0, 1, 2):
        raise ConfigError(f"gpus_per_process must be 0, 1 or 2, got {gpus_per_process}")
    return Placement(workers=nprocs, gpus_per_worker=gpus_per_process, cpus_per_worker=1,
                           backend="nccl" if gpus_per_process else "gloo")


def run_with_restarts(placement: Placement, address: Optional[str], max_failures: int,
                       wait_s: float, run_group: Callable[[GroupState], list],
                       runtime_env: Optional[dict] = None) -> list[Any]:
    with attach_ray(address, verbose=False, local_cpus=placement.workers):
        ensure_cluster_fits(placement, wait_s=wait_s, echo=lambda line: print(line, file=sys.stderr))
        attempt = 0
        while True:
            group = start_group(placement, runtime_env or {}, wait_s)
            try:
                return run_group(group)
            except ProcessFailed as err:
                if attempt >= max_failures:
                    raise
                attempt += 1
                print(f"ray_ddp: {err}; restarting all {placement.workers} processes "
                      f"({attempt}/{max_failures})", file=sys.stderr)
            finally:
                _stop_group(group)
