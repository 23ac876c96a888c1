"""A run's events: every lost worker, hang, preemption and change of world size, each
said in one line when it happens and kept in ``events`` of status.json and summary.json.
Runs on the driver; ``Event`` and ``restart_event`` also in Ray Train's controller
(observe/restarts.py records the restarts Ray Train makes itself).

Each kind is made here, by one function: failure_event and restart_event (a lost worker
or a preemption), settle_restart (where the new group resumed), hang_event,
resize_event, table_events (what the metrics table shows). Every event is an ``Event``
(its fields below) from where it is made to where it is written: its dict exists only
in the JSON files (progress.json, from Ray Train's
controller to the driver; status.json and summary.json), read back by ``Event.from_dict``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

from ray_ddp.record.names import checkpoint_dir_name, checkpoint_step
from ray_ddp.record.failures import FailureSummary

KINDS = ("failure", "hang", "preemption", "resize")


@dataclasses.dataclass(frozen=True)
class Event:
    """``type``: one of KINDS; ``time``: seconds since the epoch; ``step``: the last step
    any rank finished (as far as the run knows); ``rank`` and ``node``: where it
    happened (None for a resize, or when Ray did not say); ``cause``: one line;
    ``restarted``: a new worker group took over; ``from_checkpoint``: the checkpoint it
    loaded (None: from scratch, or no restart); ``steps_lost``: steps it had to redo;
    ``from_node``: the node whose in-memory snapshot it loaded (None: run storage; a
    snapshot is named by the new group's first report, after the event's line)."""

    type: str
    time: Optional[float]
    step: Optional[int]
    rank: Optional[int]
    node: Optional[str]
    cause: str
    from_checkpoint: Optional[str] = None
    steps_lost: int = 0
    restarted: bool = False
    from_node: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> "Event":
        """An event as a JSON file holds it; a record older than ``restarted`` is told by
        its checkpoint."""
        restarted = record.get("restarted", record.get("from_checkpoint") is not None)
        return cls(str(record.get("type") or "failure"), record.get("time"), record.get("step"),
                   record.get("rank"), record.get("node"), str(record.get("cause") or ""),
                   record.get("from_checkpoint"), int(record.get("steps_lost") or 0), bool(restarted),
                   record.get("from_node"))


def to_records(events: list[Event]) -> list[dict[str, Any]]:
    """The events as the JSON files hold them."""
    return [e.to_dict() for e in events]


def from_records(records: Optional[list[dict[str, Any]]]) -> list[Event]:
    return [Event.from_dict(r) for r in records or []]


def failure_event(failure: FailureSummary, step: Optional[int], restarted: bool, checkpoint: Optional[str],
                  preemption: bool) -> Event:
    """A failed worker group, as the driver saw it: restarted (from ``checkpoint``, None
    for scratch), or the run's end."""
    lost = max(0, step - checkpoint_step(checkpoint)) if step is not None and restarted else 0
    return Event("preemption" if preemption else "failure", time.time(), step, failure.rank, failure.node,
                 failure.cause, checkpoint if restarted else None, lost, restarted)


def restart_event(failure: FailureSummary, step: int, checkpoint: Optional[str], preemption: bool) -> Event:
    """A worker group that Ray Train restarted itself (within --max-failures, or after a
    preemption), from ``checkpoint`` (None: from scratch) after ``step``."""
    why = ("Ray Train restarted the workers at the preemption's deadline" if preemption else
           "Ray Train restarted the worker group (within --max-failures)")
    cause = why if failure.rank < 0 else f"rank {failure.rank} {_what_happened(failure)}; {why}"
    return Event("preemption" if preemption else "failure", time.time(), step,
                 failure.rank if failure.rank >= 0 else None, failure.node if failure.rank >= 0 else None,
                 cause, checkpoint, max(0, step - checkpoint_step(checkpoint)), True)


def settle_restart(event: Event, resumed_at: int, loaded_from: Optional[str], node: Optional[str]) -> Event:
    """A restart, with where its new group really started (its first words say it): a
    checkpoint, or a node's in-memory snapshot newer than it, which the failed group wrote:
    it had finished at least that step, whatever its last report or heartbeat said."""
    step = max(event.step or 0, resumed_at)
    return dataclasses.replace(event, step=step, from_checkpoint=loaded_from, from_node=node,
                               steps_lost=step - resumed_at)


def _what_happened(failure: FailureSummary) -> str:
    if failure.lost in ("process", "node"):
        return f"was lost ({failure.cause})"
    return failure.cause if failure.lost == "peer" else f"failed: {failure.cause}"


def table_events(rows: list[dict[str, Any]], stretches: list[dict[str, int]]) -> list[Event]:
    """What the metrics table shows: preemption checkpoints Ray Train restarted from at
    the deadline, and every change of world size."""
    events = []
    for r in rows:
        if r["rank"] == 0 and r.get("preempted_node"):
            events.append(Event("preemption", r["time"], int(r["step"]), None, r["preempted_node"],
                                "the node's preemption notice", checkpoint_dir_name(int(r["step"])), 0,
                                True))
    for before, after in zip(stretches, stretches[1:]):
        at = [r["time"] for r in rows if r["step"] == before["to_step"]]
        events.append(resize_event(before["to_step"], before["world_size"], after["world_size"],
                                   max(at) if at else None))
    return events


def resize_event(step: int, before: int, after: int, at: Optional[float] = None) -> Event:
    """The world size changed after ``step`` (at ``at``, default now)."""
    return Event("resize", time.time() if at is None else at, int(step), None, None,
                 f"world size {before} -> {after}")


def hang_event(stall: dict[str, Any], ranks: dict[int, dict], stacks: dict[int, dict]) -> Event:
    """A hang the watch caught (driver/hangs.py), its cause the one line to print: which
    ranks are not waiting in a collective, and where (``stacks``: each rank's verdict)."""
    stuck = sorted(r for r in ranks if not stacks[r]["waiting"])
    waiting = sorted(r for r in ranks if stacks[r]["waiting"])
    head = f"no rank finished a step for {stall['since_s']:.0f} s after step {stall['step']}"
    if stuck:
        named = "; ".join(f"rank {r} on node {ranks[r]['ip'] or ranks[r]['node'][:12]} at {stacks[r]['where']}"
                          for r in stuck)
        cause = f"hang: {head}: not in a collective: {named}"
    else:
        cause = f"hang: {head}: every rank waits in a collective (a lost message, or a peer's device)"
    if waiting and stuck:
        cause += f"; rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} wait{'' if len(waiting) > 1 else 's'} in one"
    first = stuck[0] if stuck else None
    return Event("hang", time.time(), stall["step"], first,
                 (ranks[first]["ip"] or ranks[first]["node"]) if first is not None else None, cause)


def attribute_hangs(restarts: list[Event], hangs: list[Event]) -> tuple[list[Event], list[Event]]:
    """The restarts Ray Train made, each that followed a hang the watch declared told as
    that hang (its rank, node and cause; where it restarted from and the steps lost are
    the restart's), and the hangs no restart followed (the run stopped there)."""
    out, pending = list(restarts), []
    for hang in sorted(hangs, key=lambda e: e.time or 0.0):
        k = next((i for i, e in enumerate(out) if e.type == "failure" and (e.time or 0) > (hang.time or 0)),
                 None)
        if k is None:
            pending.append(hang)
        else:
            out[k] = restarted_after_hang(hang, out[k])
    return out, pending


def restarted_after_hang(hang: Event, restart: Event) -> Event:
    """The hang, told with the restart that followed it: where the new group started
    from; the steps lost count from the hang's step too (the watch knows it from the
    heartbeats)."""
    since = checkpoint_step(restart.from_checkpoint)
    lost = max(restart.steps_lost, (hang.step or 0) - since) if restart.restarted else 0
    return dataclasses.replace(hang, from_checkpoint=restart.from_checkpoint, restarted=restart.restarted,
                               steps_lost=lost)


def merge_events(*lists: list[Event]) -> list[Event]:
    """Every event once, in time order; where two lists hold the same one (a preemption
    the driver restarted from is in the table too), the earlier list's record wins."""
    seen, out = set(), []
    for event in (e for events in lists for e in events):  # the first list's record wins
        key = (event.type, event.from_checkpoint) if event.type == "preemption" else \
            (event.type, event.step) if event.type == "resize" else (event.type, event.time)
        if key not in seen:
            seen.add(key)
            out.append(event)
    return sorted(out, key=lambda e: e.time or 0.0)


def count_restarts(events: list[Event]) -> int:
    """Restarts of the worker group: the failures, hangs and preemptions it went on from
    (from a checkpoint or from scratch)."""
    return sum(1 for e in events if e.type in ("failure", "hang", "preemption") and e.restarted)


def steps_to_redo(redo: Optional[int]) -> str:
    """': 7 steps to redo' (a restart's line ends with it), '' for none."""
    return f": {redo} step{'s' if redo != 1 else ''} to redo" if redo and redo > 0 else ""


def where_restarted(event: Event) -> str:
    """'restarted from step-00000800' / 'restarted from scratch', or '' (no restart)."""
    if not event.restarted:
        return ""
    if event.from_node is not None and event.from_checkpoint:
        return f"restarted from the snapshot of step {checkpoint_step(event.from_checkpoint)} on node {event.from_node[:8]}…"
    return f"restarted from {event.from_checkpoint or 'scratch'}"
