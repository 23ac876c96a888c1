"""What ended a worker group, in one line. Runs on the driver (and in Ray Train's
controller, for the restarts it makes; whether the driver starts a run again is
driver/restart_decision.py's).

Ray Train reports a failed worker group as one exception per rank. When a worker or its
node dies, the dead rank's entry is an actor error and the others fail on the broken
connection (a gloo "Connection reset by peer"); a transport error alone tells the user
nothing, so the line names the rank, its node, whether the process or the node was lost,
and the flag that would have let the run go on. A process Ray's memory monitor killed is
told as that (which rank, which node, what lowers its memory), not as a lost node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional


# What a surviving rank raises when a peer's process went away, by backend.
_PEER_LOST = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|"
                        r"gloo/transport|NCCL communicator was aborted|remote process exited|"
                        r"Socket Timeout|ProcessGroupNCCL.*(Watchdog|timeout)", re.IGNORECASE)


_NODE_LOST = re.compile(r"node .*(terminated|died|dead|lost)|missing too many heartbeats|"
                        r"raylet", re.IGNORECASE)


# Ray's memory monitor killing a worker, in Ray 2.60's words: the raylet's "N worker(s)
# were killed due to the node running low on memory" (older Ray: "Task was killed due
# to ..."), and the GCS's exit type for the actor it killed. Its text names the raylet
# (`ray logs raylet.out`), so it is matched before _NODE_LOST. Not the kernel's OOM killer:
# Ray cannot tell that from any SIGKILL and only guesses it among other causes.
_OUT_OF_MEMORY = re.compile(r"killed due to the node running low on memory|Worker exit type: NODE_OUT_OF_MEMORY")


_NODE_MEMORY = re.compile(r"was (\S+)GB used / (\S+)GB limit")


_OOM_IP = re.compile(r"Memory on the node \(IP: ([^,\s]+)")


# What lowers a rank's host memory; a restart with the same options would run out again.
OOM_ADVICE = ("give fewer --loader-workers, a smaller --batch-size, or --strategy fsdp (or a node with more "
              "memory); a restart with the same options would run out again")


_IP = re.compile(r"\bip: (\S+)")


_PID = re.compile(r"\bpid: (\d+)")


@dataclass(frozen=True)
class FailureSummary:
    """The rank that explains a failed worker group: ``lost`` is "process" or "node" when
    its worker or node died, "oom" when Ray killed its process for the node's memory,
    "peer" when only the survivors' broken connections are known, None for an error
    raised in training (a bug, a bad batch)."""

    rank: int
    node: str  # the node's IP address where Ray's error names it, else its node ID
    lost: Optional[str]  # also "oom": Ray's memory monitor killed its process
    cause: str
    preempted: bool = False
    node_id: str = ""  # Ray's node ID, as preemption notices name nodes ("" if not known)


def summarize_failure(worker_failures: dict[int, Exception], nodes: dict[str, Any],
                      dead_nodes: Optional[dict[str, str]] = None, ips: Optional[dict[str, str]] = None) -> FailureSummary:
    """The one rank to name: a dead worker first, then a training error, then a survivor.
    ``nodes``: each rank's node ID; ``dead_nodes``: the nodes Ray holds as dead, ID to IP
    address (cluster/nodes.py), which tell a lost node from a lost process by Ray's own
    record before its words do; ``ips``: each rank's node IP where the error names none."""
    dead_nodes = dead_nodes or {}
    ranked = []
    for rank, error in worker_failures.items():
        node_id = str(nodes.get(str(rank)) or "")
        lost, cause, preempted, ip = _classify(error, node_dead=bool(node_id) and node_id in dead_nodes)
        order = {"oom": 0, "node": 0, "process": 0, None: 1, "peer": 2}[lost]
        ranked.append((order, rank, lost, cause, preempted, ip, node_id))
    if not ranked:
        return FailureSummary(-1, "?", None, "the worker group failed")
    _, rank, lost, cause, preempted, ip, node_id = min(ranked)
    gone = sorted(int(r) for r, n in nodes.items() if n and str(n) in dead_nodes)
    if lost == "peer" and gone:  # only survivors spoke, but Ray already holds a rank's node dead: name it
        rank, lost, cause, ip, node_id = gone[0], "node", "its node died", "", str(nodes[str(gone[0])])
    node = ip or (ips or {}).get(str(rank)) or dead_nodes.get(node_id) or node_id[:12] or "?"
    return FailureSummary(rank, node, lost, cause, preempted, node_id)


def _classify(error: Exception, node_dead: bool = False) -> tuple[Optional[str], str, bool, str]:
    """(lost, cause, preempted, the node's IP address if the error names it): Ray's types
    and node table first (OutOfMemoryError, RayActorError and its ``preempted``, the
    rank's node dead), its words last (what Ray 2.60's errors keep of a node's death)."""
    from ray.exceptions import RayActorError

    inner = getattr(error, "health_check_failure", error)  # Ray Train's health check wraps it
    text = str(inner).strip()
    if _is_out_of_memory(inner, text):
        return "oom", _memory_cause(text), False, _find(_IP, text) or _find(_OOM_IP, text)
    if isinstance(inner, RayActorError):
        ip, pid = _IP.search(text), _PID.search(text)
        if node_dead or inner.preempted or _NODE_LOST.search(text):
            return "node", "its node died", bool(inner.preempted), ip[1] if ip else ""
        # Ray cannot tell a SIGKILL from a crash: it only sees the process's connection end
        return "process", f"its process{f' {pid[1]}' if pid else ''} died", False, ip[1] if ip else ""
    last = text.splitlines()[-1] if text else type(inner).__name__
    if _PEER_LOST.search(text):
        return "peer", f"lost its connection to another rank: {last[:200]}", False, ""
    return None, last, False, ""


def _is_out_of_memory(error: BaseException, text: str) -> bool:
    """Ray's memory monitor killed the process: its typed error, or its words in the
    error of the actor it killed."""
    from ray.exceptions import OutOfMemoryError

    return isinstance(error, OutOfMemoryError) or bool(_OUT_OF_MEMORY.search(text))


def _memory_cause(text: str) -> str:
    """'ran out of host memory (Ray's memory monitor killed its process 4711; the node
    had 7.61GB used / 7.75GB limit)', with what Ray's message tells."""
    pid, memory = _find(_PID, text), _NODE_MEMORY.search(text)
    node = f"; the node had {memory[1]}GB used / {memory[2]}GB limit" if memory else ""
    return f"ran out of host memory (Ray's memory monitor killed its process{f' {pid}' if pid else ''}{node})"


def _find(pattern: re.Pattern, text: str) -> str:
    found = pattern.search(text)
    return found[1] if found else ""


def describe_loss(failure: FailureSummary, step: Optional[int]) -> str:
    """'rank 1 on node 10.0.0.7 was lost (its process 4711 died) at step 37'."""
    at = f" at step {step}" if step is not None else ""
    if failure.lost == "oom":
        cause = failure.cause.removeprefix("ran out of host memory")
        return f"rank {failure.rank} on node {failure.node} ran out of host memory{at}{cause}: {OOM_ADVICE}"
    if failure.lost == "peer":
        return (f"rank {failure.rank} on node {failure.node} {failure.cause}{at}: a worker or "
                "node of the run was lost")
    return f"rank {failure.rank} on node {failure.node} was lost ({failure.cause}){at}"
