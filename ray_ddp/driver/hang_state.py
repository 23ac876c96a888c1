"""What the hang watch (driver/hangs.py) knows, and its rules: each rank's last beat of
the current worker group, when the group counts as hung, which processes were asked for
their stacks, and which processes' beats are ignored from now on. Pure (no Ray; every
call that needs the time is given ``now``); it lives in the driver's HangWatch actor
(driver/hang_actor.py).

A group is known by its processes, (node ID, pid) pairs: pids repeat across nodes, and
Ray Train may restart a group at any moment, also while the watch handles a hang of the
group before it. So whatever the watch does to a hung group (ask it for its stacks,
retire it) names that group's processes, never "the ranks it holds now".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from ray_ddp.worker.collectives import first_step_patience_s, meant_wait_patience_s

Process = tuple[str, int]  # (node ID, pid)


@dataclass
class WatchState:
    """Each rank's last beat of the current worker group (``ranks``), the processes of
    ended groups (``retired``: their late beats are ignored), and, while a hang is
    handled, the hung group's processes asked for their stacks (``asked``) and the stacks
    they sent."""

    timeout_s: float
    wait_s: Optional[float] = None  # --wait-timeout: None, the defaults of worker/collectives.py
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    retired: set[Process] = field(default_factory=set)
    retired_groups: set[int] = field(default_factory=set)  # worker groups' ids (heartbeat.group_id)
    asking: bool = False  # stacks were asked for: the asked ranks answer at their next beat
    asked: set[Process] = field(default_factory=set)
    stacks: dict[int, dict[str, Any]] = field(default_factory=dict)

    def beat(self, rank: int, pid: int, node: str, ip: str, step: int, progress: int, paused: bool,
             now: float, waiting: bool = False, group: Optional[int] = None) -> Optional[str]:
        """Note a rank's beat; "stacks" when it is one of the hung group's ranks asked
        for its stacks that has not sent them yet. ``group``: the id its worker group's
        ranks agreed on: a new id is a new group, even one whose first beat comes from a
        rank the group before did not have (an elastic run grown); without ids, a rank
        beating from another process is."""
        if (node, pid) in self.retired or group in self.retired_groups:
            return None
        known = self.ranks.get(rank)
        if group is not None:
            older = {r.get("group") for r in self.ranks.values()} - {group}
            if older:  # a new worker group: the ranks of those before it are retired
                self._retire_ranks([r for r, k in self.ranks.items() if k.get("group") in older])
                self.retired_groups |= older - {None}
                known = self.ranks.get(rank)
        if known is not None and (known["node"], known["pid"]) != (node, pid):  # a new worker group: start afresh
            self._retire_ranks(list(self.ranks))
            known = None
        if known is None or known["progress"] != progress:
            self.ranks[rank] = known = {"pid": pid, "node": node, "ip": ip, "step": step,
                                        "progress": progress, "changed_at": now, "group": group}
        known.update(paused=paused, waiting=waiting, seen_at=now)
        return "stacks" if self.asking and (node, pid) in self.asked and rank not in self.stacks else None

    def _retire_ranks(self, ranks: list[int]) -> None:
        """Those ranks' processes retired (their late beats ignored) and forgotten."""
        self.retired |= {(self.ranks[r]["node"], self.ranks[r]["pid"]) for r in ranks}
        for rank in ranks:
            del self.ranks[rank]

    def stalled(self, now: float) -> Optional[dict[str, Any]]:
        """{"step", "since_s", "processes"} when every rank has run a step and none has
        made progress for ``timeout_s``; a meant wait's patience (``wait_s``, by default
        10 times that) while any rank is in a meant wait, and the start-up's
        (first_step_patience_s: by default at least 30 min) while any is in its first
        step: a group that never finishes its first step is hung too. ``processes``: the
        hung group's, which the handling names in every call after."""
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
        return {"step": min(r["step"] for r in ranks), "since_s": since,
                "processes": sorted(processes_of(self.ranks))}

    def ask_for_stacks(self, processes: Iterable[Process]) -> dict[int, dict[str, Any]]:
        """Ask the hung group's ranks for their stacks (they answer at their next beat)
        and return them: those of ``processes`` that are still known; none when a new
        group took over since the stall was found (then there is nothing to handle)."""
        self.asking, self.asked, self.stacks = True, set(map(tuple, processes)), {}
        return {rank: dict(r) for rank, r in self.ranks.items() if (r["node"], r["pid"]) in self.asked}

    def put_stacks(self, rank: int, node: str, pid: int, text: str, waiting: bool, where: str) -> None:
        """A rank's answer; only an asked process's counts (a new group's rank is never
        asked), by its node and pid (pids repeat across nodes)."""
        if self.asking and (node, pid) in {tuple(p) for p in self.asked}:
            self.stacks[rank] = {"pid": pid, "text": text, "waiting": waiting, "where": where}

    def put_trace(self, rank: int, trace: str) -> None:
        """A rank's flight recorder, sent after its stacks (worker/collectives.py)."""
        if rank in self.stacks:
            self.stacks[rank]["trace"] = trace

    def last_step(self, processes: Optional[Iterable[Process]] = None) -> int:
        """The last step any rank of the current group finished, as far as its beats said;
        only ``processes`` ((node, pid) pairs) count when given: a group that has not
        beaten yet is not told an earlier group's steps."""
        mine = set(map(tuple, processes)) if processes is not None else None
        return max((r["step"] for r in self.ranks.values() if mine is None or (r["node"], r["pid"]) in mine),
                   default=0)

    def retire(self, processes: Iterable[Process]) -> None:
        """The hung group ``processes`` was ended (or was gone): ignore them from now on
        and stop asking. Exactly those: a group Ray Train started meanwhile is watched on."""
        gone = set(map(tuple, processes))
        self.retired |= gone
        self.ranks = {rank: r for rank, r in self.ranks.items() if (r["node"], r["pid"]) not in gone}
        self._stop_asking()

    def rearm(self, now: float) -> None:
        """The group could not be ended: watch it again from now (still stalled after
        another ``timeout_s``, it is handled again), never stay asking for stacks."""
        self._stop_asking()
        for r in self.ranks.values():
            r["changed_at"] = now

    def _stop_asking(self) -> None:
        self.asking, self.asked, self.stacks = False, set(), {}


def processes_of(ranks: dict[int, dict[str, Any]]) -> list[Process]:
    """The (node ID, pid) of each rank's process."""
    return [(r["node"], r["pid"]) for r in ranks.values()]
