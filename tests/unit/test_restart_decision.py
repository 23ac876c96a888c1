"""The driver's restart rule, as a table of what happened, the flags and the restarts so
far (no Ray: the rule is a pure function, as Ray Train's FailurePolicy is tested)."""

from __future__ import annotations

import dataclasses

import pytest

from ray_ddp.record.failures import FailureSummary
from ray_ddp.driver.restart_decision import (REPEATED_FAILURE_LIMIT, RestartPolicyConfig, RestartState,
                                             decide_restart)

LOST = FailureSummary(1, "10.0.0.7", "process", "its process 7 died", node_id="b")
NODE = FailureSummary(1, "10.0.0.7", "node", "its node died", node_id="b")
BUG = FailureSummary(0, "10.0.0.6", None, "ValueError: bad batch", node_id="a")
SURVIVOR = FailureSummary(0, "10.0.0.6", "peer", "lost its connection", node_id="a")
SPOT = FailureSummary(1, "10.0.0.7", "node", "its node died", preempted=True, node_id="b")
OOM = FailureSummary(1, "10.0.0.7", "oom", "ran out of host memory (Ray's memory monitor killed its process 7)",
                     node_id="b")

FIXED = RestartPolicyConfig(elastic=False, max_failures=None, max_preemptions=-1)
ELASTIC = RestartPolicyConfig(elastic=True, max_failures=None, max_preemptions=-1)
NODES = {"a", "b"}


@pytest.mark.parametrize("failure, policy, preempted, restart, words", [
    # a fixed run with no --max-failures stops at once, naming the flag
    (LOST, FIXED, set(), False, "pass --max-failures N"),
    (NODE, FIXED, set(), False, "pass --max-failures N"),
    # an elastic run goes on after a lost worker or node
    (LOST, ELASTIC, set(), True, "an elastic run goes on without lost workers; restart 1"),
    (NODE, ELASTIC, set(), True, "an elastic run goes on"),
    # ... but an elastic run given --max-failures leaves restarts to Ray Train: a failure
    # that reaches the driver spent them
    (LOST, dataclasses.replace(ELASTIC, max_failures=2), set(), False,
     "; --max-failures 2 restarts were spent: pass a larger --max-failures (-1: no limit)"),
    (NODE, dataclasses.replace(FIXED, max_failures=3), set(), False, "--max-failures 3 restarts were spent"),
    (LOST, dataclasses.replace(FIXED, max_failures=0), set(), False, "; pass --max-failures N (-1: no limit)"),
    # an error raised in training never restarts, and names no flag
    (BUG, ELASTIC, set(), False, ""),
    # nor does a process Ray's memory monitor killed: not a lost node, and it would run
    # out again (its own line says what to change), even on a node being preempted
    (OOM, ELASTIC, set(), False, ""),
    (OOM, FIXED, {"b"}, False, ""),
    (BUG, FIXED, {"a"}, False, ""),
    # a node that dies after its notice is a preemption, even seen only through a
    # survivor's broken connection, and even in a fixed run whose --max-failures is spent
    (LOST, FIXED, {"b"}, True, "its node was being preempted; preemption 1, not a failure"),
    (SURVIVOR, dataclasses.replace(FIXED, max_failures=0), {"b"}, True, "preemption 1"),
    (SPOT, FIXED, set(), True, "preemption 1"),
    # a notice for a node the dead rank was not on: a failure like any other
    (LOST, FIXED, {"a"}, False, "pass --max-failures N"),
    # --max-preemptions 0: the preemption ends the run, naming that flag
    (LOST, dataclasses.replace(FIXED, max_preemptions=0), {"b"}, False, "pass a larger --max-preemptions"),
])
def test_one_failure(failure, policy, preempted, restart, words):
    decision = decide_restart(failure, policy, RestartState(), preempted, NODES, "step-00000010")
    assert decision.restart is restart
    assert words in decision.reason and (words or decision.reason == "")
    assert decision.preemption is (restart and "preempt" in words)


def test_the_decision_is_pure_and_carries_the_next_state():
    state = RestartState()
    first = decide_restart(LOST, ELASTIC, state, set(), NODES, "step-1")
    assert state == RestartState(), "the state given is never changed"
    assert (first.state.restarts, first.state.repeats, first.state.last_checkpoint) == (1, 1, "step-1")
    # the same inputs, the same decision
    assert decide_restart(LOST, ELASTIC, state, set(), NODES, "step-1") == first


def test_an_elastic_run_stops_when_the_same_checkpoint_fails_again_and_again():
    state, decisions = RestartState(), []
    for _ in range(REPEATED_FAILURE_LIMIT):
        decision = decide_restart(LOST, ELASTIC, state, set(), NODES, "step-1")
        decisions.append(decision.restart)
        state = decision.state
    assert decisions == [True] * (REPEATED_FAILURE_LIMIT - 1) + [False]
    assert f"failed {REPEATED_FAILURE_LIMIT} times in a row after the same checkpoint" in decision.reason
    # a newer checkpoint is progress: the count starts again
    again = decide_restart(LOST, ELASTIC, state, set(), NODES, "step-2")
    assert again.restart and again.state.repeats == 1 and again.state.restarts == REPEATED_FAILURE_LIMIT
    # from scratch twice in a row counts as the same checkpoint (None)
    state = decide_restart(LOST, ELASTIC, RestartState(), set(), NODES, None).state
    assert decide_restart(LOST, ELASTIC, state, set(), NODES, None).state.repeats == 2


def test_a_preempted_node_is_forgiven_once_and_counted_against_max_preemptions():
    policy = dataclasses.replace(FIXED, max_failures=0, max_preemptions=2)
    first = decide_restart(SURVIVOR, policy, RestartState(), {"b"}, NODES, "step-1")
    assert first.restart and first.preemption and first.state.forgiven_nodes == {"b"}
    # the same notice does not forgive a second death: that is a failure
    second = decide_restart(SURVIVOR, policy, first.state, {"b"}, NODES, "step-2")
    assert not second.restart and "pass --max-failures N" in second.reason
    # another node's notice is a second preemption; a third goes past --max-preemptions 2
    third = decide_restart(SURVIVOR, policy, first.state, {"a", "b"}, NODES, "step-2")
    assert third.restart and third.state.preemptions == 2
    assert not decide_restart(SPOT, policy, third.state, set(), NODES, "step-3").restart
    # preemptions never count as the elastic run's restarts
    assert third.state.restarts == 0
