"""The hang watch's pieces that Ray runs (driver/hangs.py starts them from the driver):
``HangWatch``, the small actor around the WatchState (driver/hang_state.py) that the
workers' heartbeats (worker/heartbeat.py) call, keeping time by its own clock alone; and
the tasks run on a rank's node to dump, probe and kill its process (by pid: only its
node can).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Optional

from ray_ddp.driver.hang_state import Process, WatchState
from ray_ddp.worker.heartbeat import py_spy_dump

# Seconds a task on a rank's node may take (scheduled, run, answered): py-spy's dump
# (itself bounded at 10 s), and a probe or a kill.
DUMP_WAIT_S = 60.0
NODE_TASK_WAIT_S = 30.0


class HangWatch:
    """The actor around WatchState (made with ray.remote by ``start_watch``)."""

    def __init__(self, timeout_s: float, wait_s: Optional[float] = None):
        self.state = WatchState(timeout_s, wait_s)

    def beat(self, rank, pid, node, ip, step, progress, paused, waiting=False, group=None):
        return self.state.beat(rank, pid, node, ip, step, progress, paused, time.monotonic(), waiting, group)

    def stalled(self):
        return self.state.stalled(time.monotonic())

    def last_step(self, processes=None):
        return self.state.last_step(processes)

    def ask_for_stacks(self, processes: Iterable[Process]) -> dict[int, dict[str, Any]]:
        return self.state.ask_for_stacks(processes)

    def put_stacks(self, rank, node, pid, text, waiting, where):
        self.state.put_stacks(rank, node, pid, text, waiting, where)

    def put_trace(self, rank, trace):
        self.state.put_trace(rank, trace)

    def stacks(self):
        return self.state.stacks

    def retire(self, processes: Iterable[Process]):
        self.state.retire(processes)

    def rearm(self):
        self.state.rearm(time.monotonic())


def start_watch(timeout_s: float, wait_s: Optional[float]):
    """The HangWatch actor (no CPU of its own to reserve: it only counts)."""
    import ray

    return ray.remote(num_cpus=0)(HangWatch).remote(timeout_s, wait_s)


def _on_node(node_id: str):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return lambda fn: ray.remote(num_cpus=0, max_retries=0)(fn).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))


def dump_on_node(rank: dict[str, Any]) -> str:
    """py-spy's dump of a rank's process, from a task on its node; "" where py-spy cannot attach."""
    import ray

    return ray.get(_on_node(rank["node"])(py_spy_dump).remote(rank["pid"]), timeout=DUMP_WAIT_S)


def kill_on_node(rank: dict[str, Any]) -> None:
    """SIGKILL a rank's process, by a task on its node (waited for)."""
    _run_on_node(_kill, rank)


def alive_on_node(rank: dict[str, Any]) -> bool:
    """Whether a rank's process lives, asked by a task on its node."""
    return _run_on_node(_alive, rank)


def _run_on_node(fn: Callable[[int], Any], rank: dict[str, Any]) -> Any:
    import ray

    return ray.get(_on_node(rank["node"])(fn).remote(rank["pid"]), timeout=NODE_TASK_WAIT_S)


def any_alive(ranks: list[dict[str, Any]]) -> bool:
    """Whether any rank's process may live: all asked at once; True where one cannot be asked."""
    import ray

    try:
        return any(ray.get([_on_node(r["node"])(_alive).remote(r["pid"]) for r in ranks],
                           timeout=NODE_TASK_WAIT_S))
    except Exception:
        return True


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed process not yet reaped by its parent (raylet) is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _kill(pid: int) -> None:
    """SIGKILL: a hung process may not run a handler (its main thread holds a collective)."""
    import os
    import signal

    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
