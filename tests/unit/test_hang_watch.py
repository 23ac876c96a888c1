"""The hang watch's rules, without Ray: when a run counts as hung, which ranks a stack
says wait in a collective, how a hang is told once Ray Train restarted the group, and
how the driver handles one (driver/hangs.py's HangHandler, given the real HangWatch and
plain functions for Ray's calls): a group Ray restarted meanwhile is watched on, and a
handling that fails at any call leaves the watch watching."""

from __future__ import annotations

import dataclasses

import threading
import time

import pytest
from pyarrow.fs import LocalFileSystem

from ray_ddp.config.checks import parse_profile_steps
from ray_ddp.record.events import Event, attribute_hangs
from ray_ddp.driver.hang_actor import HangWatch, _alive, _kill
from ray_ddp.driver.hang_report import write_stacks
from ray_ddp.record.events import hang_event
from ray_ddp.driver.hang_state import WatchState
from ray_ddp.driver.hangs import HangHandler, end_group, gather_dumps
from ray_ddp.errors import ConfigError
from ray_ddp.record.folder import RunFolder
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
    assert w.stalled(12.5) == {"step": 4, "since_s": 10.5,  # the step every rank finished
                           "processes": [("node", 100), ("node", 101)]}


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
    assert w.stalled(now=1801) == {"step": 40, "since_s": 1801, "processes": [("node", 100), ("node", 101)]}
    _beat(w, 0, 1, now=5, step=41)  # rank 0 finished it; rank 1 has not: still its first step
    assert w.stalled(now=5 + 1799) is None


def test_wait_timeout_is_the_patience_of_a_first_step_and_of_a_meant_wait():
    # --hang-timeout 10 --wait-timeout 20: a first step or a checkpoint gets 20 s, not
    # 30 min or 100 s; a step still 10
    w = WatchState(timeout_s=10, wait_s=20)
    _beat(w, 0, 0, now=0)
    _beat(w, 1, 0, now=0)
    assert w.stalled(now=19) is None and w.stalled(now=21)["since_s"] == 21
    w = WatchState(timeout_s=10, wait_s=20)
    w.beat(0, 100, "n", "ip", 5, 5, False, now=0)
    w.beat(1, 101, "n", "ip", 5, 5, False, now=0, waiting=True)
    assert w.stalled(now=19) is None and w.stalled(now=21) is not None
    w.beat(1, 101, "n", "ip", 5, 5, False, now=0, waiting=False)
    assert w.stalled(now=11) is not None


def test_ranks_are_asked_for_their_stacks_once():
    w = WatchState(timeout_s=1)
    _beat(w, 0, 1, now=0)
    assert set(w.ask_for_stacks([("node", 100)])) == {0}
    assert _beat(w, 0, 1, now=1) == "stacks"
    w.put_stacks(0, "node", 100, "text", True, "here")
    assert _beat(w, 0, 1, now=2) is None
    w.retire([("node", 100)])
    assert _beat(w, 0, 1, now=3) is None and not w.ranks and not w.asking


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
    w.retire([("node-a", 4711)])
    assert w.beat(0, 4711, "node-a", "10.0.0.7", 3, 4, False, now=1) is None and w.ranks == {}
    # the same pid on another node is another process: a new group's rank, watched
    w.beat(0, 4711, "node-b", "10.0.0.8", 0, 1, False, now=2)
    assert w.ranks[0]["node"] == "node-b"


def test_a_group_that_could_not_be_ended_is_watched_again_never_left_asking():
    w = WatchState(timeout_s=10)
    for rank in (0, 1):
        w.beat(rank, 100 + rank, "n", "ip", 5, 5, False, now=0)
    stall = w.stalled(now=11)
    w.ask_for_stacks(stall["processes"])  # the monitor asked for stacks, then could not kill the group
    w.rearm(now=11)
    assert not w.asking and w.stalled(now=15) is None  # a new timeout from the failed attempt
    assert w.stalled(now=22) is not None  # still stuck: handled again


def test_ending_a_group_retries_a_kill_that_did_not_take():
    import subprocess

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


def _hung_group(watch, now=0.0):
    """Ranks 0 and 1 (pids 101, 102 on node "n") at step 5, then silent; ``watch``: a
    WatchState (given the time) or a HangWatch (its own clock)."""
    for rank in (0, 1):
        if isinstance(watch, WatchState):
            watch.beat(rank, 101 + rank, "n", "ip", 5, 5, False, now=now)
        else:
            watch.beat(rank, 101 + rank, "n", "ip", 5, 5, False)


def test_a_group_ray_restarted_while_the_stacks_were_asked_for_is_watched_on():
    # TRUST3_REPROS.md D2: Ray Train restarted the group while the watch collected the
    # hung group's stacks; retiring "whatever ranks it holds" retired the new group, and a
    # later hang of it was never found (the collective's timeout ended it, ~110 min)
    w = WatchState(timeout_s=10)
    _hung_group(w)
    stall = w.stalled(now=11.0)
    assert stall["processes"] == [("n", 101), ("n", 102)]
    assert set(w.ask_for_stacks(stall["processes"])) == {0, 1}
    for rank, pid in ((0, 201), (1, 202)):  # the new group: never asked for stacks
        assert w.beat(rank, pid, "n", "ip", 0, 0, False, now=15.0) is None
    w.put_stacks(0, "n", 201, "the new group's", False, "x")  # nor are its stacks taken for the hung group's
    assert w.stacks == {}
    w.retire(stall["processes"])  # after the kill: exactly the hung group
    assert w.retired == {("n", 101), ("n", 102)} and not w.asking
    for rank, pid in ((0, 201), (1, 202)):
        w.beat(rank, pid, "n", "ip", 1, 1, False, now=20.0)
    assert {r["pid"] for r in w.ranks.values()} == {201, 202}
    assert w.stalled(now=29.0) is None
    assert w.stalled(now=30.5) == {"step": 1, "since_s": 10.5, "processes": [("n", 201), ("n", 202)]}


def test_a_group_replaced_before_it_was_asked_is_not_asked_nor_ended():
    w = WatchState(timeout_s=10)
    _hung_group(w)
    stall = w.stalled(now=11.0)
    w.beat(0, 201, "n", "ip", 0, 0, False, now=11.5)  # Ray Train's new group, between the two calls
    assert w.ask_for_stacks(stall["processes"]) == {}


class Ranks:
    """The ranks' processes as the handler sees them through its callables: killed by
    ``kill``, each dumped by ``dump`` (py-spy's text)."""

    def __init__(self):
        self.killed: set[int] = set()

    def kill(self, rank):
        self.killed.add(rank["pid"])

    def alive(self, rank):
        return rank["pid"] not in self.killed

    def dump(self, rank):
        return f"py-spy of {rank['pid']}\n"


def _handler(tmp_path, watch, ranks, lines, fail=(), lose_reply=(), answering=(), **kw):
    """A HangHandler on a HangWatch called directly (not as an actor); ``fail``: the
    watch's methods whose call raises before it reaches the watch, ``lose_reply``:
    those that reach it and then raise (a Ray timeout on a call that ran);
    ``answering``: the ranks whose heartbeat answers when asked (waiting in a collective)."""

    def call(method, *args):
        if method in fail:
            raise ConnectionError(f"{method}: the actor did not answer")
        result = getattr(watch, method)(*args)
        for rank in answering if method == "ask_for_stacks" else ():
            if watch.beat(rank, 101 + rank, "n", "ip", 5, 5, False) == "stacks":
                watch.put_stacks(rank, "n", 101 + rank, "its own stacks\n", True, "distributed_c10d.py:1 in all_reduce")
        if method in lose_reply:
            raise TimeoutError(f"{method}: no reply within 30 s")
        return result

    found: list = []
    options = dict(call=call, folder=RunFolder(LocalFileSystem(), str(tmp_path)), echo=lines.append,
                   declare=found.append,
                   write=lambda folder, stacks: write_stacks(LocalFileSystem(), folder, stacks),
                   dump=ranks.dump, kill=ranks.kill, alive=ranks.alive, any_alive=lambda rs: True,
                   stacks_wait_s=0.0, trace_wait_s=0.0, kill_wait_s=0.0)
    return HangHandler(**{**options, **kw}), found


def _stall(watch):
    return watch.state.stalled(time.monotonic() + 100)


def _watches_a_new_group(watch):
    """The watch still watches: not asking, and a new group's hang is found."""
    assert not watch.state.asking
    for rank in (0, 1):
        watch.beat(rank, 301 + rank, "n", "ip", 7, 7, False)
    assert watch.state.stalled(time.monotonic() + 11)["processes"] == [("n", 301), ("n", 302)]


def test_a_hang_is_told_written_and_its_group_ended_and_retired(tmp_path):
    watch, ranks, lines = HangWatch(10), Ranks(), []
    _hung_group(watch)
    handler, found = _handler(tmp_path, watch, ranks, lines, answering=(0,), stacks_wait_s=0.6)
    handler.handle(_stall(watch))
    [event] = found
    assert (event.type, event.step, event.rank) == ("hang", 5, 1)
    [line] = lines
    assert line.startswith("hang: no rank finished a step for ") and f"stacks in {tmp_path}/hangs/5/" in line
    assert "not in a collective: rank 1 on node ip at its heartbeat stopped too; rank 0 waits in one" in line
    assert (tmp_path / "hangs" / "5" / "rank-0.txt").read_text().endswith("its own stacks\n")
    assert "py-spy of 102" in (tmp_path / "hangs" / "5" / "rank-1.txt").read_text()  # its heartbeat is stuck
    assert ranks.killed == {101, 102} and watch.state.retired == {("n", 101), ("n", 102)}
    _watches_a_new_group(watch)


@pytest.mark.parametrize("where", ["ask_for_stacks", "stacks", "dump", "write", "retire"])
def test_a_handling_that_fails_at_any_call_leaves_the_watch_watching(tmp_path, where):
    watch, ranks, lines = HangWatch(10), Ranks(), []
    _hung_group(watch)

    def dump(rank):
        raise RuntimeError("py-spy's task failed")

    def write(folder, stacks):
        raise OSError("read-only file system")

    failing = {"ask_for_stacks": dict(lose_reply=("ask_for_stacks",)), "stacks": dict(fail=("stacks",)),
               "dump": dict(dump=dump), "write": dict(write=write), "retire": dict(fail=("retire",))}[where]
    handler, found = _handler(tmp_path, watch, ranks, lines, stacks_wait_s=0.6, **failing)
    handler.handle(_stall(watch))
    assert ranks.killed == {101, 102}, lines  # whatever failed, the hung group is ended
    warnings = [x for x in lines if x.startswith("warning:")]
    if where == "retire":  # the watch did not answer: the handler settles it at its next poll
        assert watch.state.asking and len(warnings) == 1, lines
        handler.call = lambda method, *args: getattr(watch, method)(*args)  # the actor answers again
        assert handler.settle_left() and not watch.state.asking
        assert watch.state.retired == {("n", 101), ("n", 102)}
    elif where == "ask_for_stacks":  # no stacks to tell: one line, the group ended all the same
        assert found == [] and len(warnings) == 1 and "ask_for_stacks" in warnings[0], lines
    else:  # the line and the event all the same
        [said] = [x for x in lines if x.startswith("hang:")]
        assert len(found) == 1 and not warnings, lines
        if where == "write":
            assert "stacks not written (OSError: read-only file system)" in said
        else:  # no rank answered (the stacks' call failed, or no heartbeat runs here): py-spy's dump
            written = (tmp_path / "hangs" / "5" / "rank-0.txt").read_text()
            assert ("did not answer (RuntimeError)" if where == "dump" else "py-spy of 101") in written
    _watches_a_new_group(watch)


def test_a_group_gone_or_replaced_before_its_handling_is_retired_not_declared(tmp_path):
    watch, ranks, lines = HangWatch(10), Ranks(), []
    _hung_group(watch)
    handler, found = _handler(tmp_path, watch, ranks, lines, any_alive=lambda rs: False)
    handler.handle(_stall(watch))  # every process died: a failure Ray Train restarts from, its own event
    assert found == [] and lines == [] and ranks.killed == set() and not watch.state.asking
    watch.state.retired.clear()  # the same processes, hung again
    _hung_group(watch)
    stall = _stall(watch)
    watch.beat(0, 201, "n", "ip", 0, 0, False)  # Ray Train restarted the group before it was asked
    handler, found = _handler(tmp_path, watch, ranks, lines)
    handler.handle(stall)
    assert found == [] and ranks.killed == set() and not watch.state.asking
    assert set(watch.state.ranks) == {0} and watch.state.ranks[0]["pid"] == 201


def test_the_stuck_ranks_are_dumped_all_at_once():
    def slow_dump(rank):
        time.sleep(0.5)
        return f"py-spy of {rank['pid']}\n"

    ranks = {r: {"pid": 100 + r, "node": "n"} for r in range(6)}
    started = time.monotonic()
    texts = gather_dumps(ranks, slow_dump, timeout_s=10)
    took = time.monotonic() - started
    assert texts == {r: f"py-spy of {100 + r}\n" for r in range(6)}
    assert took < 1.5, f"6 dumps of 0.5 s took {took:.2f} s: one after another"


def test_a_dump_that_fails_or_never_returns_is_a_line_and_waits_no_longer_than_the_timeout():
    release = threading.Event()

    def dump(rank):
        if rank["pid"] == 100:
            raise TimeoutError("GetTimeoutError")
        if rank["pid"] == 101:
            release.wait(30)  # py-spy's task never scheduled: a node that is gone
        return "py-spy\n"

    ranks = {r: {"pid": 100 + r, "node": "n"} for r in range(3)}
    started = time.monotonic()
    texts = gather_dumps(ranks, dump, timeout_s=0.5)
    took = time.monotonic() - started
    release.set()
    assert took < 2, took
    assert texts[0] == "no stacks: py-spy on its node did not answer (TimeoutError)\n"
    assert texts[1] == "no stacks: py-spy on its node did not answer within 0.5 s\n"
    assert texts[2] == "py-spy\n"


def test_stacks_count_only_from_the_asked_process_on_its_own_node():
    """pids repeat across nodes: a process on another node with the asked pid is not it."""
    w = WatchState(timeout_s=1)
    w.beat(0, 100, "node-a", "ip", 1, 1, False, now=0.0)
    w.ask_for_stacks([("node-a", 100)])
    w.put_stacks(0, "node-b", 100, "another node's process", False, "x")
    assert w.stacks == {}
    w.put_stacks(0, "node-a", 100, "its own", True, "y")
    assert w.stacks[0]["text"] == "its own"


def test_a_grown_group_whose_new_rank_beats_first_is_watched_whole():
    """An elastic run grows from 2 ranks to 4 (a new worker group): its rank 2, a slot the
    group before did not have, beats first. The group's id tells it is new: the old ranks
    are retired, and none of the new group's, rank 2 included, is (by pids alone, new
    rank 0's beat retired rank 2 with the old ranks, and its hang went unseen)."""
    w = WatchState(timeout_s=10)
    for rank, pid in ((0, 101), (1, 102)):
        w.beat(rank, pid, "n", "ip", 5, 5, False, now=0.0, group=1)
    w.beat(2, 203, "n", "ip", 0, 1, False, now=1.0, group=2)
    for rank, pid in ((0, 201), (1, 202), (3, 204)):
        w.beat(rank, pid, "n", "ip", 0, 1, False, now=1.0, group=2)
    assert sorted(w.ranks) == [0, 1, 2, 3] and ("n", 203) not in w.retired
    assert w.beat(0, 101, "n", "ip", 6, 6, False, now=2.0, group=1) is None  # a late beat of the old group
    assert sorted(w.ranks) == [0, 1, 2, 3] and w.ranks[0]["pid"] == 201
    stall = w.stalled(now=12.0)
    assert stall is not None and ("n", 203) in stall["processes"]
