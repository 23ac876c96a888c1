"""The hang watch's rules, without Ray: when a run counts as hung, which ranks a stack
says wait in a collective, and how a hang is told once Ray Train restarted the group."""

from __future__ import annotations

import dataclasses

import sys
import threading
import time

import pytest

from ray_ddp.config.checks import parse_profile_steps
from ray_ddp.driver.events import Event, attribute_hangs
from ray_ddp.driver.hangs import WatchState, hang_event
from ray_ddp.errors import ConfigError
from ray_ddp.worker.heartbeat import capture_stacks, classify_frame


def _beat(w, rank, progress, now, pid=None, paused=False, step=None):
    return w.beat(rank, pid or 100 + rank, "node", "10.0.0.7", step if step is not None else progress,
                  progress, paused, now)


def test_a_run_is_hung_only_when_no_rank_progressed_for_the_timeout():
    w = WatchState(timeout_s=10)
    _beat(w, 0, 0, now=0)
    _beat(w, 1, 0, now=0)
    assert w.stalled(1000) is None  # the first step gets the start-up's patience (a compile, a slow start)
    _beat(w, 0, 5, now=1)
    _beat(w, 1, 4, now=2)
    assert w.stalled(11) is None  # rank 1 moved 9 s ago
    _beat(w, 0, 5, now=13)  # the same count: no progress
    assert w.stalled(12.5) == {"step": 4, "since_s": 10.5}  # the step every rank finished


def test_a_meant_wait_and_a_new_worker_group_are_not_hangs():
    w = WatchState(timeout_s=10)
    _beat(w, 0, 3, now=0)
    _beat(w, 1, 3, now=0, paused=True)  # waiting for a preemption's deadline
    assert w.stalled(60) is None
    _beat(w, 1, 0, now=61, pid=999)  # a restarted group: the old ranks are forgotten
    assert set(w.ranks) == {1} and w.stalled(150) is None
    assert _beat(w, 0, 9, now=151) is None and 0 not in w.ranks  # the old rank 0's late beat is ignored


def test_a_group_that_never_finishes_its_first_step_is_hung_after_the_start_ups_patience():
    from ray_ddp.worker.collectives import MEANT_WAIT_FACTOR, START_UP_TIMEOUT_S, first_step_patience_s

    # at least the start-up's 30 min (a compile, a resumed stream skipping to its step)
    assert first_step_patience_s(10) == START_UP_TIMEOUT_S == 1800
    assert first_step_patience_s(600) == MEANT_WAIT_FACTOR * 600
    w = WatchState(timeout_s=10)
    _beat(w, 0, 0, now=0, step=40)
    _beat(w, 1, 0, now=0, step=40)  # both resumed at step 40; neither ever finishes step 41
    assert w.stalled(now=1799) is None
    assert w.stalled(now=1801) == {"step": 40, "since_s": 1801}
    _beat(w, 0, 1, now=5, step=41)  # rank 0 finished it; rank 1 has not: still its first step
    assert w.stalled(now=5 + 1799) is None


def test_wait_timeout_is_the_patience_of_a_first_step_and_of_a_meant_wait():
    # --hang-timeout 10 --wait-timeout 20: a first step or a checkpoint gets 20 s, not
    # 30 min or 100 s; a step still 10
    w = WatchState(timeout_s=10, wait_s=20)
    _beat(w, 0, 0, now=0)
    _beat(w, 1, 0, now=0)
    assert w.stalled(now=19) is None and w.stalled(now=21) == {"step": 0, "since_s": 21}
    w = WatchState(timeout_s=10, wait_s=20)
    w.beat(0, 100, "n", "ip", 5, 5, False, now=0)
    w.beat(1, 101, "n", "ip", 5, 5, False, now=0, waiting=True)
    assert w.stalled(now=19) is None and w.stalled(now=21) is not None
    w.beat(1, 101, "n", "ip", 5, 5, False, now=0, waiting=False)
    assert w.stalled(now=11) is not None


def test_ranks_are_asked_for_their_stacks_once():
    w = WatchState(timeout_s=1)
    _beat(w, 0, 1, now=0)
    w.asking = True
    assert _beat(w, 0, 1, now=1) == "stacks"
    w.stacks[0] = {"waiting": True}
    assert _beat(w, 0, 1, now=2) is None
    w.retire()
    assert _beat(w, 0, 1, now=3) is None and not w.ranks


def test_a_stack_in_a_sleep_is_not_a_collective_and_one_in_torch_distributed_is():
    started, release = threading.Event(), threading.Event()

    def user_code():
        started.set()
        release.wait(30)

    t = threading.Thread(target=user_code)
    t.start()
    started.wait(10)
    time.sleep(0.1)
    text, waiting, where = capture_stacks(t.ident)
    release.set()
    t.join()
    # the innermost frame outside the standard library is this file's user_code
    assert not waiting and where.startswith("test_hang_watch.py:") and where.endswith("in user_code")
    assert "release.wait(30)" in text

    class Code:
        co_filename, co_name = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", "all_reduce"

    class Frame:
        f_code, f_lineno, f_back = Code, 2800, None

    assert classify_frame(Frame) == (True, "distributed_c10d.py:2800 in all_reduce")


def test_the_hang_line_names_the_ranks_outside_a_collective():
    ranks = {0: {"node": "n0", "ip": "10.0.0.7"}, 1: {"node": "n1", "ip": "10.0.0.8"}}
    stacks = {0: {"waiting": True, "where": "graph.py:1 in _engine_run_backward"},
              1: {"waiting": False, "where": "reader.py:12 in read"}}
    event = hang_event({"step": 14, "since_s": 20.4}, ranks, stacks)
    assert event.cause == ("hang: no rank finished a step for 20 s after step 14: not in a "
                              "collective: rank 1 on node 10.0.0.8 at reader.py:12 in read; rank 0 waits in one")
    assert (event.type, event.rank, event.node, event.step) == ("hang", 1, "10.0.0.8", 14)


def test_a_restart_after_a_hang_is_told_as_the_hang():
    hang = Event("hang", 10.0, 14, 1, "10.0.0.8", "hang: x")
    restart = Event("failure", 30.0, 10, None, None, "restarted", "step-00000010", 0, True)
    told, pending = attribute_hangs([restart], [hang])
    assert pending == [] and told == [dataclasses.replace(hang, from_checkpoint="step-00000010", steps_lost=4,
                                                          restarted=True)]
    told, pending = attribute_hangs([], [hang])  # the run stopped there: the driver tells it
    assert told == [] and pending == [hang]


@pytest.mark.parametrize("spec", ["5", "0-3", "7-6", "a-b", "3-"])
def test_profile_takes_a_range_of_steps(spec):
    with pytest.raises(ConfigError, match="--profile takes START-END"):
        parse_profile_steps(spec)


def test_profile_ranges_parse():
    assert parse_profile_steps("10-15") == (10, 15) and parse_profile_steps("4-4") == (4, 4)


def test_a_retired_process_is_known_by_its_node_and_pid():
    w = WatchState(timeout_s=10)
    w.beat(0, 4711, "node-a", "10.0.0.7", 3, 3, False, now=0)
    w.retire()
    assert w.beat(0, 4711, "node-a", "10.0.0.7", 3, 4, False, now=1) is None and w.ranks == {}
    # the same pid on another node is another process: a new group's rank, watched
    w.beat(0, 4711, "node-b", "10.0.0.8", 0, 1, False, now=2)
    assert w.ranks[0]["node"] == "node-b"


def test_a_group_that_could_not_be_ended_is_watched_again_never_left_asking():
    w = WatchState(timeout_s=10)
    for rank in (0, 1):
        w.beat(rank, 100 + rank, "n", "ip", 5, 5, False, now=0)
    assert w.stalled(now=11) is not None
    w.asking = True  # the monitor asked for stacks, then could not kill the group
    w.rearm(now=11)
    assert not w.asking and w.stalled(now=15) is None  # a new timeout from the failed attempt
    assert w.stalled(now=22) is not None  # still stuck: handled again


def test_ending_a_group_retries_a_kill_that_did_not_take():
    import subprocess

    from ray_ddp.driver.hangs import _alive, _kill, end_group

    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    ranks = [{"pid": p.pid} for p in procs]
    tries = []

    def kill(rank):  # the first round's tasks time out (a loaded node): nothing is killed
        tries.append(rank["pid"])
        if len(tries) <= 2:
            raise TimeoutError("the kill task did not run")
        _kill(rank["pid"])

    def alive(rank):
        [proc] = [p for p in procs if p.pid == rank["pid"]]
        proc.poll()  # reap it, as its parent (the raylet) does
        return _alive(rank["pid"])

    assert end_group(ranks, kill, alive, wait_s=0.05)
    assert len(tries) == 4 and all(p.wait(timeout=5) == -9 for p in procs)
    # a process that never dies: the group is reported not ended (the watch re-arms)
    stubborn = subprocess.Popen(["sleep", "60"])
    try:
        assert not end_group([{"pid": stubborn.pid}], lambda rank: None, alive=lambda rank: True, tries=2, wait_s=0)
    finally:
        stubborn.kill()
        stubborn.wait()


def test_a_meant_wait_gets_a_larger_timeout_not_none():
    from ray_ddp.worker.collectives import MEANT_WAIT_FACTOR

    w = WatchState(timeout_s=10)
    w.beat(0, 100, "n", "ip", 5, 5, False, now=0)
    w.beat(1, 101, "n", "ip", 5, 5, False, now=0, waiting=True)  # rank 1 uploads a checkpoint
    assert w.stalled(now=10 * MEANT_WAIT_FACTOR - 1) is None
    assert w.stalled(now=10 * MEANT_WAIT_FACTOR + 1) is not None  # an upload that never ends is a hang
    w.beat(1, 101, "n", "ip", 5, 5, False, now=20, waiting=False)  # the wait ended, no step since
    assert w.stalled(now=21) is not None


def test_on_nccl_rays_detector_only_observes_so_one_watch_owns_the_kill():
    from ray_ddp.cluster.runtime_env import nccl_hang_env

    env = nccl_hang_env("nccl", 120.0)
    assert env["RAY_TRAIN_NCCL_RAS_ACTION"] == "observe" and env["RAY_TRAIN_NCCL_RAS_CONFIRM_DURATION_S"] == "120.0"
    assert nccl_hang_env("gloo", 120.0) == {} and nccl_hang_env("nccl", 0) == {}


def test_the_last_step_counts_only_the_processes_asked_about():
    w = WatchState(timeout_s=10)
    w.beat(0, 100, "node-a", "ip", 14, 14, False, now=0)
    w.beat(1, 101, "node-a", "ip", 13, 13, False, now=0)
    assert w.last_step() == 14 and w.last_step([("node-a", 101)]) == 13
    assert w.last_step([("node-a", 200), ("node-b", 100)]) == 0  # a new group that has not beaten yet
