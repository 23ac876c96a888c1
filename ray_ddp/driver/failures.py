"""What ended a worker group, in one line, and whether the driver starts it again. Runs
on the driver.

Ray Train reports a failed worker group as one exception per rank. When a worker or its
node dies, the dead rank's entry is an actor error and the others fail on the broken
connection (a gloo "Connection reset by peer"); a transport error alone tells the user
nothing, so the line names the rank, its node, whether the process or the node was lost,
and the flag that would have let the run go on.

Two restarts are the driver's own, beyond Ray's ``--max-failures`` (each starts a new
TorchTrainer from the newest checkpoint):
- an elastic run (``--workers MIN-MAX``) given no ``--max-failures`` expects nodes to come
  and go: it restarts after every lost worker or node, but a failure that repeats from
  the same checkpoint (a bug that kills the process, not a lost node) ends it after
  ``REPEATED_FAILURE_LIMIT`` tries;
- a node that dies after its preemption notice was preempted, whenever it dies: the run
  restarts from the preemption checkpoint, counted against ``--max-preemptions``, never
  against ``--max-failures``.

"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional


# An elastic run stops when its worker group fails this many times in a row from the same
# checkpoint: the failure is the code's, not a node's.
REPEATED_FAILURE_LIMIT = 3


# What a surviving rank raises when a peer's process went away, by backend.
_PEER_LOST = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|"
                        r"gloo/transport|NCCL communicator was aborted|remote process exited|"
                        r"Socket Timeout|ProcessGroupNCCL.*(Watchdog|timeout)", re.IGNORECASE)


_NODE_LOST = re.compile(r"node .*(terminated|died|dead|lost)|missing too many heartbeats|"
                        r"raylet", re.IGNORECASE)


_IP = re.compile(r"\bip: (\S+)")


_PID = re.compile(r"\bpid: (\d+)")


@dataclass(frozen=True)
class FailureSummary:
    """The rank that explains a failed worker group: ``lost`` is "process" or "node" when
    its worker or node died, "peer" when only the survivors' broken connections are
    known, None for an error raised in training (a bug, a bad batch)."""

    rank: int
    node: str  # the node's IP address where Ray's error names it, else its node ID
    lost: Optional[str]
    cause: str
    preempted: bool = False
    node_id: str = ""  # Ray's node ID, as preemption notices name nodes ("" if not known)


def summarize_failure(worker_failures: dict[int, Exception], nodes: dict[str, Any]) -> FailureSummary:
    """The one rank to name: a dead worker first, then a training error, then a survivor."""
    ranked = []
    for rank, error in worker_failures.items():
        lost, cause, preempted, ip = _classify(error)
        order = {"node": 0, "process": 0, None: 1, "peer": 2}[lost]
        ranked.append((order, rank, lost, cause, preempted, ip))
    if not ranked:
        return FailureSummary(-1, "?", None, "the worker group failed")
    _, rank, lost, cause, preempted, ip = min(ranked)
    node_id = str(nodes.get(str(rank)) or "")
    return FailureSummary(rank, ip or node_id[:12] or "?", lost, cause, preempted, node_id)


def _classify(error: Exception) -> tuple[Optional[str], str, bool, str]:
    """(lost, cause, preempted, the node's IP address if the error names it)."""
    from ray.exceptions import RayActorError

    inner = getattr(error, "health_check_failure", error)  # Ray Train's health check wraps it
    text = str(inner).strip()
    if isinstance(inner, RayActorError):
        ip, pid = _IP.search(text), _PID.search(text)
        if _NODE_LOST.search(text) or inner.preempted:
            return "node", "its node died", bool(inner.preempted), ip[1] if ip else ""
        # Ray cannot tell a SIGKILL from a crash: it only sees the process's connection end
        return "process", f"its process{f' {pid[1]}' if pid else ''} died", False, ip[1] if ip else ""
    last = text.splitlines()[-1] if text else type(inner).__name__
    if _PEER_LOST.search(text):
        return "peer", f"lost its connection to another rank: {last[:200]}", False, ""
    return None, last, False, ""


def describe_loss(failure: FailureSummary, step: Optional[int]) -> str:
    """'rank 1 on node 10.0.0.7 was lost (its process 4711 died) at step 37'."""
    at = f" at step {step}" if step is not None else ""
    if failure.lost == "peer":
        return (f"rank {failure.rank} on node {failure.node} {failure.cause}{at}: a worker or "
                "node of the run was lost")
    return f"rank {failure.rank} on node {failure.node} was lost ({failure.cause}){at}"


@dataclass
class RestartState:
    """The driver's restarts so far: after which checkpoint the last failures came, and
    how many came in a row from it; the preemptions whose node's death was forgiven."""

    last_checkpoint: Optional[str] = "-"
    repeats: int = 0
    restarts: int = 0
    preemptions: int = 0
    forgiven_nodes: set = field(default_factory=set)

    def decide(self, failure: FailureSummary, elastic: bool, max_failures: Optional[int],
               max_preemptions: int, preempted_nodes: set[str], run_nodes: set[str],
               checkpoint: Optional[str]) -> Optional[str]:
        """Why the run restarts (a few words for the restart line), or None to stop.
        ``preempted_nodes``: the nodes whose preemption notice the run saw; ``run_nodes``:
        the nodes its ranks ran on."""
        if failure.lost is None:
            return None  # an error in training: restarting would raise it again
        self.repeats = self.repeats + 1 if checkpoint == self.last_checkpoint else 1
        self.last_checkpoint = checkpoint
        # the dead rank's node was being preempted; or only survivors' broken connections
        # are known, and a node of the run was: its death is the preemption's
        noticed = (preempted_nodes & run_nodes if failure.lost == "peer" else
                   preempted_nodes & {failure.node_id}) - self.forgiven_nodes
        if failure.preempted or noticed:
            if max_preemptions != -1 and self.preemptions >= max_preemptions:
                return None
            self.preemptions += 1
            self.forgiven_nodes |= noticed
            return f"its node was being preempted; preemption {self.preemptions}, not a failure"
        if elastic and max_failures is None and self.repeats < REPEATED_FAILURE_LIMIT:
            self.restarts += 1
            return f"an elastic run goes on without lost workers; restart {self.restarts}"
        return None

    def why_stopped(self, failure: FailureSummary, elastic: bool, max_failures: Optional[int]) -> str:
        """The end of the one line that ends the run: what would have let it go on."""
        if failure.lost is None:
            return ""
        if elastic and max_failures is None and self.repeats >= REPEATED_FAILURE_LIMIT:
            return (f"; it failed {self.repeats} times in a row after the same checkpoint, so it "
                    "is not a lost node: look at that rank's error (--verbose shows Ray's logs)")
        return ("; pass --max-failures N (-1: no limit) to let the run restart from its latest "
                "checkpoint")
