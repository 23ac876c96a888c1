"""A node's preemption notice, seen by the loop: a checkpoint at once, then no more
steps until Ray restarts the run without that node. Runs on workers."""

from __future__ import annotations

import time
from typing import Optional

# When a drain names no deadline, Ray restarts the run this long after the notice
# (ray.train.v2 DEFAULT_PREEMPTION_DEADLINE_S).
DEFAULT_PREEMPTION_WAIT_S = 120.0
# How long past the deadline a rank waits for the restart before it trains on (the drain
# was called off, or the node outlived its deadline).
RESTART_WAIT_S = 60.0


class PreemptionState:
    """The preemptions this rank has answered; each is answered once."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, ...]] = set()

    def new_notice(self, session) -> Optional[dict]:
        """A new preemption of a node of this run, as metrics columns (the preempted
        nodes and the deadline, in seconds since the epoch), or None. Asked of the
        session on every rank at once (a barrier through Ray)."""
        info = session.preemption()
        if info is None or info.node_ids in self.seen:
            return None
        self.seen.add(info.node_ids)
        deadline = info.deadline_ms / 1000 if info.deadline_ms else time.time() + DEFAULT_PREEMPTION_WAIT_S
        return {"preempted_node": ",".join(info.node_ids), "preemption_deadline": deadline}


def wait_for_restart(deadline: float) -> None:
    """After a preemption checkpoint: train no further (those steps would be lost with the
    node) and let Ray restart the run from that checkpoint, which it does at the deadline
    (counting it against --max-preemptions)."""
    while time.time() < deadline + RESTART_WAIT_S:
        time.sleep(0.5)
