"""Whether the driver starts a failed run again: a pure function of what happened, the
run's flags and the restarts so far, as Ray Train's FailurePolicy decides within one fit.
Runs on the driver; unit-tested without Ray (tests/unit/test_restart_decision.py).

Ray Train restarts a worker group itself within ``--max-failures`` (and after a
preemption, within ``--max-preemptions``). Two restarts are the driver's own, beyond
those, each a new TorchTrainer from the newest checkpoint:
- an elastic run (``--workers MIN-MAX``) given no ``--max-failures`` expects nodes to come
  and go: it restarts after every lost worker or node, but a failure that repeats from
  the same checkpoint (a bug that kills the process, not a lost node) ends it after
  ``REPEATED_FAILURE_LIMIT`` tries;
- a node that dies after its preemption notice was preempted, whenever it dies: the run
  restarts from the preemption checkpoint, counted against ``--max-preemptions``, never
  against ``--max-failures``.
An error raised in training (a bug, a bad batch) never restarts: it would be raised again;
nor does a process Ray's memory monitor killed (out of host memory): it is no lost node,
and the same options would run out again.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ray_ddp.record.failures import FailureSummary

# An elastic run stops when its worker group fails this many times in a row from the same
# checkpoint: the failure is the code's, not a node's.
REPEATED_FAILURE_LIMIT = 3


@dataclasses.dataclass(frozen=True)
class RestartPolicyConfig:
    """The flags that decide: ``elastic`` (--workers MIN-MAX), ``max_failures`` (None:
    not given) and ``max_preemptions`` (-1: no limit)."""

    elastic: bool
    max_failures: Optional[int]
    max_preemptions: int


@dataclasses.dataclass(frozen=True)
class RestartState:
    """The driver's restarts so far in this command: the checkpoint the last failure came
    after and how many came in a row from it, the restarts and preemptions counted, and
    the nodes whose death was already forgiven as a preemption."""

    last_checkpoint: Optional[str] = "-"  # "-": no failure yet (None is "no checkpoint")
    repeats: int = 0
    restarts: int = 0
    preemptions: int = 0
    forgiven_nodes: frozenset = frozenset()


@dataclasses.dataclass(frozen=True)
class RestartDecision:
    """``restart``: the driver starts the run again; ``reason``: for a restart, the few
    words of its line ("an elastic run goes on ..."), for a stop, the end of the line that
    ends the run (what would have let it go on; "" for an error in training);
    ``preemption``: counted as a preemption, not a failure; ``state``: the restarts so
    far, this decision included."""

    restart: bool
    reason: str
    preemption: bool
    state: RestartState


def decide_restart(failure: FailureSummary, policy: RestartPolicyConfig, state: RestartState,
                   preempted_nodes: frozenset | set, run_nodes: frozenset | set,
                   checkpoint: Optional[str]) -> RestartDecision:
    """What the driver does after ``failure`` ended a fit, given the nodes whose
    preemption notice the run saw, the nodes its ranks ran on, and the newest usable
    checkpoint (None: none)."""
    # an error in training: restarting would raise it again; a process Ray's memory monitor
    # killed: the same options would run out of memory again (its line says what to change)
    if failure.lost in (None, "oom"):
        return RestartDecision(False, "", False, state)
    repeats = state.repeats + 1 if checkpoint == state.last_checkpoint else 1
    state = dataclasses.replace(state, last_checkpoint=checkpoint, repeats=repeats)
    # the dead rank's node was being preempted; or only survivors' broken connections are
    # known, and a node of the run was: its death is the preemption's
    noticed = frozenset(preempted_nodes) & (frozenset(run_nodes) if failure.lost == "peer"
                                            else frozenset({failure.node_id}))
    noticed -= state.forgiven_nodes
    if failure.preempted or noticed:
        if policy.max_preemptions != -1 and state.preemptions >= policy.max_preemptions:
            return RestartDecision(False, f"; its node was being preempted, and --max-preemptions "
                                          f"{policy.max_preemptions} were spent: pass a larger "
                                          "--max-preemptions (-1: no limit)", False, state)
        state = dataclasses.replace(state, preemptions=state.preemptions + 1,
                                    forgiven_nodes=state.forgiven_nodes | noticed)
        return RestartDecision(True, f"its node was being preempted; preemption {state.preemptions}, "
                                     "not a failure", True, state)
    if policy.elastic and policy.max_failures is None:
        if repeats < REPEATED_FAILURE_LIMIT:
            state = dataclasses.replace(state, restarts=state.restarts + 1)
            return RestartDecision(True, f"an elastic run goes on without lost workers; restart "
                                         f"{state.restarts}", False, state)
        return RestartDecision(False, f"; it failed {repeats} times in a row after the same checkpoint, so "
                                      "it is not a lost node: look at that rank's error (--verbose shows "
                                      "Ray's logs)", False, state)
    spent = policy.max_failures or 0  # > 0: Ray Train restarted within them, and this failure spent them
    ask = (f"--max-failures {spent} restarts were spent: pass a larger --max-failures" if spent > 0
           else "pass --max-failures N")
    return RestartDecision(False, f"; {ask} (-1: no limit) to let the run restart from its latest checkpoint",
                           False, state)
