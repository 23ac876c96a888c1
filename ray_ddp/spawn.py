"""Bring your own DDP code: ``ray_ddp.spawn`` in place of ``mp.spawn``, and the engine of
``ray-ddp launch`` for torchrun-style scripts.

Runs on the driver, which places N Ray actors (one GPU, a pair, or a CPU each; one
placement group, so the job starts whole or not at all) and runs the user's code in
them. Each process finds in its environment what ``dist.init_process_group()`` (env://)
needs: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and a free
MASTER_PORT on rank 0's node, where rank 0's actor hosts the rendezvous store for the
group's whole life (as torchrun's agent does). As Ray Train does, a node's processes all
see the node's GPUs of all of them (CUDA_VISIBLE_DEVICES), local rank k owning the k-th
(so torchrun's ``torch.cuda.set_device(LOCAL_RANK)`` works unchanged), and
``ray_ddp.device()`` gives a process its own GPU, or the CPU to a process given none.
The code in the actors (``_Process``) is the only part that runs on the workers.
"""

from __future__ import annotations

import collections
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from .config import ConfigError
from .devices import PlacementConfig
from .worker_env import PROCESS_DEVICES_ENV, plan_node_env


DEFAULT_WAIT_S = 900.0  # as `ray-ddp train --wait-for-resources`


class ProcessFailed(RuntimeError):
    """A spawned process raised or exited non-zero; ``rank`` says which."""

    def __init__(self, rank: int, message: str, exit_code: Optional[int] = None,
                 stderr_tail: Sequence[str] = ()):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank, self.exit_code, self.stderr_tail = rank, exit_code, list(stderr_tail)


def device(index: int = 0) -> torch.device:
    """This process's device: its (first, or ``index``-th) GPU, else the CPU."""
    own = devices()
    return own[index] if own[0].type == "cuda" else own[0]


def devices() -> list[torch.device]:
    """All GPUs Ray gave this process (two for gpus_per_process=2), or [cpu]."""
    return select_devices(os.environ, torch.cuda.is_available())


def select_devices(env: Mapping[str, str], cuda_available: bool) -> list[torch.device]:
    """The devices a process with environment ``env`` owns: the GPUs its launcher named in
    PROCESS_DEVICES_ENV (indices into CUDA_VISIBLE_DEVICES), or [cpu] if it named none or
    there is no CUDA. Outside spawn/launch (no such variable), every visible GPU."""
    if not cuda_available:
        return [torch.device("cpu")]
    if PROCESS_DEVICES_ENV not in env:
        return [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    own = [torch.device(f"cuda:{i}") for i in env[PROCESS_DEVICES_ENV].split(",") if i]
    return own or [torch.device("cpu")]


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
class _Group:
    actors: list
    placement_group: Any


def _start_group(placement: PlacementConfig, runtime_env: dict, wait_s: float) -> _Group:
    """Reserve every process's resources at once (a placement group), waiting at most
    ``wait_s`` seconds (other work may hold what the preflight saw free), then start the
    actors and rank 0's rendezvous store."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from .cluster import describe_need

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
    return _Group(actors, pg)


def _stop_group(group: _Group) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for actor in group.actors:
        ray.kill(actor)
    remove_placement_group(group.placement_group)


def _join(refs: Sequence, check: Optional[Callable[[int, Any], None]] = None,
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
    from .worker_env import importable_env

    placement = _placement(nprocs, gpus_per_process)
    return _run_with_restarts(placement, address, max_failures, wait_for_resources,
                              lambda group: _join([a.call.remote(fn, rank, tuple(args))
                                                   for rank, a in enumerate(group.actors)]),
                              runtime_env=importable_env(fn.__module__))


def launch(argv: list[str], nprocs: int, gpus_per_process: int = 0,
           address: Optional[str] = None, max_failures: int = 0,
           wait_for_resources: float = DEFAULT_WAIT_S) -> int:
    """Run a torchrun-style script in ``nprocs`` processes; returns its exit status
    (rank 0's, or the first failing rank's). Every rank's output lines are printed here
    as they come, prefixed ``[rankN]:`` (stdout to stdout, stderr to stderr); a failed
    rank is named with its error and the last lines of its stderr, as torchrun does."""
    placement = _placement(nprocs, gpus_per_process)
    try:
        results = _run_with_restarts(placement, address, max_failures, wait_for_resources,
                                     lambda group: _join_scripts(group, argv))
    except ProcessFailed as err:
        print(f"ray-ddp launch: {err}", file=sys.stderr)
        if err.stderr_tail:
            print(f"ray-ddp launch: the last lines rank {err.rank} wrote to stderr:", file=sys.stderr)
            for line in err.stderr_tail:
                print(f"  [rank{err.rank}]: {line}", file=sys.stderr)
        code = err.exit_code or 1
        return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as shells say
    return results[0][0]


def _join_scripts(group: _Group, argv: list[str], poll_s: float = 0.2) -> list[tuple[int, list[str]]]:
    """Run the script on every rank, printing every rank's lines as they come, until all
    exit 0 or one fails (the others may be blocked in a collective with it)."""
    import ray

    refs = [a.run_script.remote(argv) for a in group.actors]
    printed = [0] * len(refs)

    def print_new() -> None:
        batches = ray.get([a.read_output.remote(n) for a, n in zip(group.actors, printed)])
        for rank, lines in enumerate(batches):
            printed[rank] += len(lines)
            for stream, line in lines:
                print(_with_rank(rank, line), file=sys.stdout if stream == "stdout" else sys.stderr,
                      flush=True)

    def check(rank: int, result: tuple[int, list[str]]) -> None:
        code, tail = result
        if code != 0:
            print_new()  # everything the rank said before the summary
            tail = [_without_rank(rank, line) for line in tail]
            said = _error_line(tail)
            raise ProcessFailed(rank, f"{said}; exited with status {code}" if said else
                                f"exited with status {code}", exit_code=code, stderr_tail=tail)

    results = _join(refs, check, on_wait=print_new, poll_s=poll_s)
    print_new()
    return results


def _with_rank(rank: int, line: str) -> str:
    """``[rankN]: line``; PyTorch's own excepthook already prefixes a traceback so (after
    init_process_group), and the prefix is not doubled."""
    return line if line.startswith(f"[rank{rank}]:") else f"[rank{rank}]: {line}"


def _without_rank(rank: int, line: str) -> str:
    prefix = f"[rank{rank}]: "
    return line[len(prefix):] if line.startswith(prefix) else line


def _error_line(tail: Sequence[str]) -> str:
    """A Python traceback's last line (``RuntimeError: ...``), else the last line at all."""
    lines = [line for line in tail if line.strip()]
    return lines[-1].strip() if lines else ""


def _placement(nprocs: int, gpus_per_process: int) -> PlacementConfig:
    if nprocs < 1:
        raise ConfigError(f"nprocs must be a positive integer, got {nprocs}")
    if gpus_per_process not in (0, 1, 2):
        raise ConfigError(f"gpus_per_process must be 0, 1 or 2, got {gpus_per_process}")
    return PlacementConfig(workers=nprocs, gpus_per_worker=gpus_per_process, cpus_per_worker=1,
                           backend="nccl" if gpus_per_process else "gloo")


def _run_with_restarts(placement: PlacementConfig, address: Optional[str], max_failures: int,
                       wait_s: float, run_group: Callable[[_Group], list],
                       runtime_env: Optional[dict] = None) -> list[Any]:
    from .cluster import attach_ray
    from .cluster import ensure_cluster_fits

    with attach_ray(address, verbose=False, local_cpus=placement.workers):
        ensure_cluster_fits(placement, wait_s=wait_s, echo=lambda line: print(line, file=sys.stderr))
        attempt = 0
        while True:
            group = _start_group(placement, runtime_env or {}, wait_s)
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
