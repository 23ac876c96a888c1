"""The hang watch (``--hang-timeout``): notice when no rank has finished a step for that
long, write every rank's stacks to ``<run>/hangs/<step>/rank-<r>.txt``, say in one line
which ranks are not waiting in a collective, and end the worker group so Ray Train
restarts it from the latest checkpoint (counted against --max-failures). Runs on the
driver: ``HangMonitor``'s thread polls the HangWatch actor (driver/hang_actor.py, whose
state and rules are driver/hang_state.py) and ``HangHandler`` handles each hang (what is
said and written: driver/hang_report.py).

Without it a rank stuck in a read or a kernel holds its peers in their next collective:
on gloo until a health check happens to fail, on NCCL until the process group's timeout
(10-30 min), and nothing says which rank or where. Time is kept by the actor's clock
alone (when a rank's count last changed), so nodes' clocks never matter.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from ray_ddp.record.events import Event
from ray_ddp.driver.hang_actor import (DUMP_WAIT_S, alive_on_node, any_alive, dump_on_node, kill_on_node,
                                       start_watch)
from ray_ddp.driver.hang_report import write_stacks
from ray_ddp.record.events import hang_event
from ray_ddp.driver.hang_state import Process
from ray_ddp.record.folder import RunFolder

# Seconds the handling waits for the ranks' own stacks (before asking py-spy), then their
# records, and for any one call to the watch actor.
STACKS_WAIT_S = 10.0
TRACE_WAIT_S = 1.0
CALL_WAIT_S = 30.0


class HangMonitor:
    """The driver's side: a thread that polls the watch and hands each hang to a
    HangHandler that calls the actor and the ranks' nodes through Ray. ``hangs``: the
    events so far (where the run restarted from is filled in later)."""

    def __init__(self, timeout_s: float, folder: RunFolder, echo: Callable[[str], None],
                 wait_s: Optional[float] = None):
        self.timeout_s, self.echo = timeout_s, echo
        self.hangs: list[Event] = []
        self.actor = start_watch(timeout_s, wait_s) if timeout_s > 0 else None
        self.handler = HangHandler(
            call=self._call, folder=folder, echo=echo, declare=lambda event: self.hangs.append(event),
            write=lambda path, stacks: write_stacks(folder.fs, path, stacks), dump=dump_on_node,
            kill=kill_on_node, alive=alive_on_node, any_alive=any_alive)
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

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.actor, method).remote(*args), timeout=CALL_WAIT_S)

    def _run(self) -> None:
        poll = min(5.0, max(0.5, self.timeout_s / 10))
        while not self._stop.wait(poll):
            try:
                self.handler.settle_left()
                stall = self._call("stalled")
                if stall is not None:
                    self.handler.handle(stall)
            except Exception as err:  # the watch must never end a run it could not judge
                self.echo(f"warning: the hang watch could not check the ranks ({type(err).__name__}: {err})")


class HangHandler:
    """What the driver does about one hang, each step through a callable it is given:
    ``call(method, *args)`` the watch actor's methods, ``dump``/``kill``/``alive`` a rank's
    process on its node (``any_alive`` all of them at once), ``write(folder, stacks)``
    the storage, ``echo`` the line, ``declare`` the event. HangMonitor gives it Ray's;
    tests give it plain functions and a HangWatch called directly.

    Stacks, line and event are best-effort; ending the group is not: whatever fails
    before, the hung processes are killed (retried), and whatever call fails, the watch is
    never left asking. A group it could not end is watched again, and handled again."""

    def __init__(self, call: Callable[..., Any], folder: RunFolder, echo: Callable[[str], None],
                 declare: Callable[[Event], None], write: Callable[[str, dict], None],
                 dump: Callable[[dict], str], kill: Callable[[dict], None], alive: Callable[[dict], bool],
                 any_alive: Callable[[list], bool], stacks_wait_s: float = STACKS_WAIT_S,
                 trace_wait_s: float = TRACE_WAIT_S, dump_wait_s: float = DUMP_WAIT_S, kill_wait_s: float = 1.0):
        self.call, self.folder, self.echo, self.declare, self.write = call, folder, echo, declare, write
        self.dump, self.kill, self.alive, self.any_alive = dump, kill, alive, any_alive
        self.stacks_wait_s, self.trace_wait_s = stacks_wait_s, trace_wait_s
        self.dump_wait_s, self.kill_wait_s = dump_wait_s, kill_wait_s
        self._unsettled: Optional[tuple[list[Process], bool]] = None  # a retire/rearm the actor missed

    def handle(self, stall: dict[str, Any]) -> None:
        """Ask the hung group (``stall["processes"]``, never whatever group the watch
        holds by then: Ray Train may have restarted it meanwhile) for its stacks, tell
        and write them, end the group, and retire exactly its processes."""
        processes = [tuple(p) for p in stall["processes"]]
        # enough to kill by, should the actor not answer with the ranks' records
        group: list[dict[str, Any]] = [{"node": node, "pid": pid} for node, pid in processes]
        ended, failed = False, None
        try:
            ranks = self.call("ask_for_stacks", processes)
            if ranks and self.any_alive(list(ranks.values())):
                group = list(ranks.values())
                self._tell(stall, ranks)
            else:  # replaced or all gone: a failure Ray Train restarts from (its own event), not a hang
                group, ended = [], True
        except Exception as err:
            failed = err
        finally:
            if not ended:
                ended = end_group(group, self.kill, self.alive, wait_s=self.kill_wait_s)
                if not ended:
                    self.echo("warning: the hang watch could not end the hung worker group (its kills did "
                              "not take); it keeps watching and tries again")
            self._unsettled = (processes, ended)
            settled = self.settle_left()
        if failed is not None or not settled:
            why = f"{type(failed).__name__}: {failed}" if failed is not None else "the watch did not answer"
            self.echo(f"warning: the hang watch's handling of the hang after step {stall['step']} failed "
                      f"({why}); {'the group was ended; ' if ended else ''}it keeps watching")

    def settle_left(self) -> bool:
        """Retire the handled group (or re-arm the watch on one it could not end), if the
        actor has not been told yet; whether it is told. The monitor calls this before
        every poll: a watch left asking would never find a hang again."""
        if self._unsettled is None:
            return True
        processes, ended = self._unsettled
        try:
            self.call("retire", processes) if ended else self.call("rearm")
        except Exception:
            return False
        self._unsettled = None
        return True

    def _tell(self, stall: dict[str, Any], ranks: dict[int, dict[str, Any]]) -> None:
        stacks = self.collect_stacks(ranks)
        event = hang_event(stall, ranks, stacks)
        self.declare(event)  # before the write: a restart Ray Train makes while it runs is this hang's
        folder = self.folder.hangs(stall["step"])
        try:
            self.write(folder, stacks)
            where = f"stacks in {folder}/"
        except Exception as err:  # an unwritable hangs/ must not keep a hung group alive
            where = f"stacks not written ({type(err).__name__}: {err})"
        self.echo(f"{event.cause}; {where}; ending the worker group")

    def collect_stacks(self, ranks: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Every rank's stacks: its own answer, else py-spy's on its node, else a line
        saying neither came (a loaded node, a node that is gone)."""
        deadline = time.monotonic() + self.stacks_wait_s
        stacks: dict[int, dict[str, Any]] = {}
        while time.monotonic() < deadline and len(stacks) < len(ranks):
            time.sleep(min(0.5, self.stacks_wait_s))
            try:
                stacks = dict(self.call("stacks"))
            except Exception:
                break
        if stacks:  # each rank's flight recorder follows its stacks: a moment more for them
            time.sleep(self.trace_wait_s)
            try:
                stacks = dict(self.call("stacks"))
            except Exception:
                pass
        stacks = {rank: s for rank, s in stacks.items() if rank in ranks}
        stuck = {rank: r for rank, r in ranks.items() if rank not in stacks}  # its heartbeat is stuck too
        for rank, text in gather_dumps(stuck, self.dump, self.dump_wait_s).items():
            stacks[rank] = {"text": text or "no stacks: the rank did not answer and py-spy could not attach\n",
                            "waiting": False, "where": "its heartbeat stopped too"}
        return stacks


def gather_dumps(ranks: dict[int, dict[str, Any]], dump: Callable[[dict], str],
                 timeout_s: float) -> dict[int, str]:
    """``dump(rank)`` of every rank at once, each in a thread of its own: stuck ranks cost
    one dump's time (up to ``timeout_s``), not one after another before the kill. A dump
    that fails, or has not answered by then, is a line saying so."""
    texts = {rank: f"no stacks: py-spy on its node did not answer within {timeout_s:g} s\n" for rank in ranks}

    def dump_one(rank: int) -> None:
        try:
            texts[rank] = dump(ranks[rank])
        except Exception as err:
            texts[rank] = f"no stacks: py-spy on its node did not answer ({type(err).__name__})\n"

    threads = [threading.Thread(target=dump_one, args=(rank,), name=f"ray_ddp-py-spy-{rank}", daemon=True)
               for rank in ranks]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return dict(texts)  # a dump that answers later changes nothing


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
