"""The hang watch (``--hang-timeout``): notice when no rank has finished a step for that
long, write every rank's stacks to ``<run>/hangs/<step>/rank-<r>.txt``, say in one line
which ranks are not waiting in a collective, and end the worker group so Ray Train
restarts it from the latest checkpoint (counted against --max-failures). Runs on the
driver; ``HangWatch`` is a small actor the workers' heartbeats (worker/heartbeat.py) call.

Without it a rank stuck in a read or a kernel holds its peers in their next collective:
on gloo until a health check happens to fail, on NCCL until the process group's timeout
(10-30 min), and nothing says which rank or where. Time is kept by the actor's clock
alone (when a rank's count last changed), so nodes' clocks never matter.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional
from ray_ddp.run_folder import RunFolder
from ray_ddp.driver.events import Event
from ray_ddp.worker.collectives import describe_collectives, first_step_patience_s, meant_wait_patience_s
from ray_ddp.worker.heartbeat import py_spy_dump

# Seconds the watch waits for the ranks' own stacks (before asking py-spy), then their records.
STACKS_WAIT_S = 10.0
TRACE_WAIT_S = 1.0


@dataclass
class WatchState:
    """What the watch knows: each rank's last beat of the current worker group, and the
    processes of ended groups (whose late beats are ignored)."""

    timeout_s: float
    wait_s: Optional[float] = None  # --wait-timeout: None, the defaults of worker/collectives.py
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    retired: set = field(default_factory=set)  # (node, pid) of ended groups' processes: pids repeat across nodes
    asking: bool = False  # stacks were asked for: the ranks answer at their next beat
    stacks: dict[int, dict[str, Any]] = field(default_factory=dict)

    def beat(self, rank: int, pid: int, node: str, ip: str, step: int, progress: int, paused: bool,
             now: float, waiting: bool = False) -> Optional[str]:
        if (node, pid) in self.retired:
            return None
        known = self.ranks.get(rank)
        if known is not None and (known["node"], known["pid"]) != (node, pid):  # a new worker group: start afresh
            self.retired |= {(r["node"], r["pid"]) for r in self.ranks.values()}
            self.ranks = {}
            known = None
        if known is None or known["progress"] != progress:
            self.ranks[rank] = known = {"pid": pid, "node": node, "ip": ip, "step": step,
                                        "progress": progress, "changed_at": now}
        known.update(paused=paused, waiting=waiting, seen_at=now)
        return "stacks" if self.asking and rank not in self.stacks else None

    def stalled(self, now: float) -> Optional[dict[str, Any]]:
        """{"step", "since_s"} when every rank has run a step and none has made progress
        for ``timeout_s``; a meant wait's patience (``wait_s``, by default 10 times that)
        while any rank is in a meant wait, and the start-up's (first_step_patience_s: by
        default at least 30 min) while any is in its first step: a group that never
        finishes its first step is hung too."""
        ranks = list(self.ranks.values())
        if not ranks or self.asking or any(r.get("paused") for r in ranks):
            return None
        since = now - max(r["changed_at"] for r in ranks)
        if any(r["progress"] == 0 for r in ranks):
            patience = first_step_patience_s(self.timeout_s, self.wait_s)
        elif any(r.get("waiting") for r in ranks):
            patience = meant_wait_patience_s(self.timeout_s, self.wait_s)
        else:
            patience = self.timeout_s
        if since < patience:
            return None
        return {"step": min(r["step"] for r in ranks), "since_s": since}

    def last_step(self, processes=None) -> int:
        """The last step any rank of the current group finished, as far as its beats said;
        only ``processes`` ((node, pid) pairs) count when given: a group that has not
        beaten yet is not told an earlier group's steps."""
        mine = set(map(tuple, processes)) if processes is not None else None
        return max((r["step"] for r in self.ranks.values() if mine is None or (r["node"], r["pid"]) in mine),
                   default=0)

    def retire(self) -> None:
        """The group was ended: forget it and ignore its processes from now on."""
        self.retired |= {(r["node"], r["pid"]) for r in self.ranks.values()}
        self.ranks, self.stacks, self.asking = {}, {}, False

    def rearm(self, now: float) -> None:
        """The group could not be ended: watch it again from now (still stalled after
        another ``timeout_s``, it is handled again), never stay asking for stacks."""
        self.stacks, self.asking = {}, False
        for r in self.ranks.values():
            r["changed_at"] = now


class HangWatch:
    """The actor around WatchState (made with ray.remote in HangMonitor)."""

    def __init__(self, timeout_s: float, wait_s: Optional[float] = None):
        self.state = WatchState(timeout_s, wait_s)

    def beat(self, rank, pid, node, ip, step, progress, paused, waiting=False):
        return self.state.beat(rank, pid, node, ip, step, progress, paused, time.monotonic(), waiting)

    def stalled(self):
        return self.state.stalled(time.monotonic())

    def last_step(self, processes=None):
        return self.state.last_step(processes)

    def ask_for_stacks(self) -> dict[int, dict[str, Any]]:
        self.state.asking = True
        return {rank: dict(r) for rank, r in self.state.ranks.items()}

    def put_stacks(self, rank, pid, text, waiting, where):
        self.state.stacks[rank] = {"pid": pid, "text": text, "waiting": waiting, "where": where}

    def put_trace(self, rank, trace):
        """A rank's flight recorder, sent after its stacks (worker/collectives.py)."""
        if rank in self.state.stacks:
            self.state.stacks[rank]["trace"] = trace

    def stacks(self):
        return self.state.stacks

    def retire(self):
        self.state.retire()

    def rearm(self):
        self.state.rearm(time.monotonic())


class HangMonitor:
    """The driver's side: a thread that polls the watch, and on a hang writes the stacks,
    says the line, records the event and ends the group. ``hangs``: the events so far
    (where the run restarted from is filled in later)."""

    def __init__(self, timeout_s: float, store, run_path: str, echo: Callable[[str], None],
                 wait_s: Optional[float] = None):
        import ray

        self.timeout_s, self.store, self.run_path, self.echo = timeout_s, store, run_path, echo
        self.hangs: list[Event] = []
        self.actor = ray.remote(num_cpus=0)(HangWatch).remote(timeout_s, wait_s) if timeout_s > 0 else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ray_ddp-hang-watch", daemon=True)
        if self.actor is not None:
            self._thread.start()

    def take_hangs(self) -> list[Event]:
        """The hangs declared since the last call."""
        hangs, self.hangs = self.hangs, []
        return hangs

    def close(self) -> None:
        import ray

        self._stop.set()
        if self.actor is not None:
            self._thread.join(timeout=30)
            ray.kill(self.actor)

    def _run(self) -> None:
        import ray

        poll = min(5.0, max(0.5, self.timeout_s / 10))
        while not self._stop.wait(poll):
            try:
                stall = ray.get(self.actor.stalled.remote(), timeout=30)
                if stall is not None:
                    self._handle(stall)
            except Exception as err:  # the watch must never end a run it could not judge
                self.echo(f"warning: the hang watch could not check the ranks ({type(err).__name__}: {err})")

    def _handle(self, stall: dict[str, Any]) -> None:
        """Stacks, line and event are best-effort; ending the group is not: whatever
        fails before, the hung processes are killed (retried), and the watch is never
        left asking. A group it could not end is watched again, and handled again."""
        import ray

        ranks = ray.get(self.actor.ask_for_stacks.remote(), timeout=30)
        if ranks and not _any_alive(list(ranks.values())):
            # all gone: a failure Ray Train restarts from (its own event), not a hang
            ray.get(self.actor.retire.remote(), timeout=30)
            return
        ended = False
        try:
            stacks = self._collect_stacks(ranks)
            folder = RunFolder(self.run_path).hangs(stall["step"])
            try:
                write_stacks(self.store.fs, folder, stacks)
                where = f"stacks in {folder}/"
            except Exception as err:  # an unwritable hangs/ must not keep a hung group alive
                where = f"stacks not written ({type(err).__name__}: {err})"
            event = hang_event(stall, ranks, stacks)
            self.hangs.append(event)
            self.echo(f"{event.cause}; {where}; ending the worker group")
        finally:
            ended = end_group(list(ranks.values()), _on_ranks_node(_kill), _on_ranks_node(_alive))
            if not ended:
                self.echo("warning: the hang watch could not end the hung worker group (its kills did "
                          "not take); it keeps watching and tries again")
            ray.get(self.actor.retire.remote() if ended else self.actor.rearm.remote(), timeout=30)

    def _collect_stacks(self, ranks: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Every rank's stacks: its own answer, else py-spy's on its node, else a line
        saying neither came (a loaded node, a node that is gone)."""
        import ray

        deadline = time.monotonic() + STACKS_WAIT_S
        stacks: dict[int, dict[str, Any]] = {}
        while time.monotonic() < deadline and len(stacks) < len(ranks):
            time.sleep(0.5)
            try:
                stacks = ray.get(self.actor.stacks.remote(), timeout=30)
            except Exception:
                break
        if stacks:  # each rank's flight recorder follows its stacks: a moment more for them
            time.sleep(TRACE_WAIT_S)
            try:
                stacks = ray.get(self.actor.stacks.remote(), timeout=30)
            except Exception:
                pass
        for rank in set(ranks) - set(stacks):  # its heartbeat thread is stuck too: ask py-spy
            try:
                text = ray.get(_dump_on_node(ranks[rank]), timeout=60)
            except Exception as err:
                text = f"no stacks: py-spy on its node did not answer ({type(err).__name__})\n"
            stacks[rank] = {"text": text or "no stacks: the rank did not answer and py-spy could "
                            "not attach\n", "waiting": False, "where": "its heartbeat stopped too"}
        return stacks


def hang_event(stall: dict[str, Any], ranks: dict[int, dict], stacks: dict[int, dict]) -> Event:
    """The hang as an event (driver/events.py), its cause the one line to print."""
    stuck = sorted(r for r in ranks if not stacks[r]["waiting"])
    waiting = sorted(r for r in ranks if stacks[r]["waiting"])
    head = f"no rank finished a step for {stall['since_s']:.0f} s after step {stall['step']}"
    if stuck:
        named = "; ".join(f"rank {r} on node {ranks[r]['ip'] or ranks[r]['node'][:12]} at {stacks[r]['where']}" for r in stuck)
        cause = f"hang: {head}: not in a collective: {named}"
    else:
        cause = f"hang: {head}: every rank waits in a collective (a lost message, or a peer's device)"
    if waiting and stuck:
        cause += f"; rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} wait{'' if len(waiting) > 1 else 's'} in one"
    first = stuck[0] if stuck else None
    return Event("hang", time.time(), stall["step"], first,
                 (ranks[first]["ip"] or ranks[first]["node"]) if first is not None else None, cause)


def write_stacks(fs, folder: str, stacks: dict[int, dict[str, Any]]) -> None:
    """rank-<r>.txt: the verdict, where, and the stacks; rank-<r>.collectives.json: the
    rank's flight recorder (worker/collectives.py), where it answered with one."""
    fs.create_dir(folder, recursive=True)
    for rank, s in sorted(stacks.items()):
        verdict = "waiting in a collective" if s["waiting"] else "NOT in a collective"
        text = s["text"]
        if s.get("trace"):
            try:
                text += "\n--- collectives (PyTorch's flight recorder) ---\n" + describe_collectives(s["trace"]) + "\n"
            except Exception:  # a record this cannot read: the JSON file still holds it
                pass
        with fs.open_output_stream(f"{folder}/rank-{rank}.txt") as f:
            f.write(f"rank {rank}: {verdict}, at {s['where']}\n{text}".encode())
        if s.get("trace"):
            with fs.open_output_stream(f"{folder}/rank-{rank}.collectives.json") as f:
                f.write(s["trace"].encode())


def _on_node(node_id: str):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return lambda fn: ray.remote(num_cpus=0, max_retries=0)(fn).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))


def _dump_on_node(rank: dict[str, Any]):
    return _on_node(rank["node"])(py_spy_dump).remote(rank["pid"])


def end_group(ranks: list[dict[str, Any]], kill: Callable[[dict], None], alive: Callable[[dict], bool],
              tries: int = 3, wait_s: float = 1.0) -> bool:
    """SIGKILL every rank's process, and again while any still lives (a task that timed
    out, a signal not yet delivered), up to ``tries`` rounds; whether all are gone. A
    rank whose liveness cannot be asked (its node is gone) counts as gone."""
    left = list(ranks)
    for attempt in range(tries):
        for rank in left:
            try:
                kill(rank)
            except Exception:
                pass  # asked again below
        time.sleep(wait_s * attempt)
        still = []
        for rank in left:
            try:
                if alive(rank):
                    still.append(rank)
            except Exception:
                pass
        left = still
        if not left:
            return True
    return False


def _on_ranks_node(fn: Callable[[int], Any]) -> Callable[[dict[str, Any]], Any]:
    """``fn(pid)`` run on a rank's node and waited for (at most 30 s)."""
    import ray

    return lambda rank: ray.get(_on_node(rank["node"])(fn).remote(rank["pid"]), timeout=30)


def _any_alive(ranks: list[dict[str, Any]]) -> bool:
    """Whether any rank's process may live: all asked at once; True where one cannot be asked."""
    import ray

    try:
        return any(ray.get([_on_node(r["node"])(_alive).remote(r["pid"]) for r in ranks], timeout=30))
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
