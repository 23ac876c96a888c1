"""A run's events without Ray: a lost worker's record, what the metrics table adds
(preemption checkpoints, resizes), merging them once each, the restarts column, and an
event's way through its JSON record and back."""

import dataclasses

from ray_ddp.record.events import (Event, count_restarts, failure_event, merge_events, restart_event,
                                   restarted_after_hang, table_events, where_restarted)
from ray_ddp.record.failures import FailureSummary
from ray_ddp.record.progress import format_event

FIELDS = {"type", "time", "step", "rank", "node", "cause", "from_checkpoint", "steps_lost", "restarted",
          "from_node"}


def test_a_lost_worker_is_recorded_with_every_field():
    lost = FailureSummary(1, "10.0.0.7", "process", "its process 7 died", node_id="b")
    event = failure_event(lost, 37, True, "step-00000020", preemption=False).to_dict()
    assert set(event) == FIELDS
    assert {k: event[k] for k in FIELDS - {"time"}} == {
        "type": "failure", "step": 37, "rank": 1, "node": "10.0.0.7", "cause": "its process 7 died",
        "from_checkpoint": "step-00000020", "steps_lost": 17, "restarted": True, "from_node": None}
    stopped = failure_event(lost, 37, False, "step-00000020", preemption=False)  # the run ended there
    assert (stopped.from_checkpoint, stopped.steps_lost, stopped.restarted) == (None, 0, False)
    assert where_restarted(stopped) == "" and count_restarts([stopped]) == 0


def test_a_restart_from_scratch_counts_every_step_and_says_so():
    lost = FailureSummary(1, "10.0.0.7", "process", "its process 7 died")
    event = restart_event(lost, 14, None, preemption=False)
    assert set(event.to_dict()) == FIELDS
    assert (event.rank, event.node, event.from_checkpoint, event.steps_lost, event.restarted) == \
        (1, "10.0.0.7", None, 14, True)
    assert event.cause == ("rank 1 was lost (its process 7 died); Ray Train restarted the worker group "
                           "(within --max-failures)")
    assert format_event(event) == (f"failure after step 14: {event.cause}; restarted from scratch: "
                                   "14 steps to redo")
    assert count_restarts([event]) == 1  # a restart from scratch is a restart
    later = restart_event(lost, 53, "step-00000040", preemption=False)
    assert (later.from_checkpoint, later.steps_lost) == ("step-00000040", 13)
    assert format_event(later).endswith("; restarted from step-00000040: 13 steps to redo")
    # Ray named no rank: the event says so rather than guess
    unknown = restart_event(FailureSummary(-1, "?", None, ""), 9, None, preemption=True)
    assert (unknown.type, unknown.rank, unknown.node) == ("preemption", None, None)


def test_a_hang_is_told_with_the_restart_that_followed_it():
    hang = Event("hang", 5.0, 14, 1, "10.0.0.7", "hang: no rank finished a step")
    scratch = restart_event(FailureSummary(1, "10.0.0.7", "peer", "lost its connection"), 12, None, False)
    told = restarted_after_hang(hang, scratch)
    assert (told.type, told.from_checkpoint, told.restarted, told.steps_lost) == ("hang", None, True, 14)
    # a record from before "restarted" was kept: read back, its checkpoint tells
    old_record = {k: v for k, v in hang.to_dict().items() if k != "restarted"}
    old_record.update(type="failure", from_checkpoint="step-00000010", steps_lost=2)
    old = Event.from_dict(old_record)
    assert old.restarted and restarted_after_hang(hang, old).steps_lost == 4 and count_restarts([old]) == 1


def test_the_table_adds_preemptions_and_resizes_and_each_is_kept_once():
    rows = [{"step": 40, "rank": 0, "time": 10.0, "preempted_node": None},
            {"step": 50, "rank": 0, "time": 20.0, "preempted_node": "b"},
            {"step": 60, "rank": 0, "time": 30.0, "preempted_node": None}]
    stretches = [{"world_size": 2, "from_step": 0, "to_step": 50}, {"world_size": 1, "from_step": 50, "to_step": 60}]
    events = table_events(rows, stretches)
    assert [(e.type, e.step, e.from_checkpoint) for e in events] == [
        ("preemption", 50, "step-00000050"), ("resize", 50, None)]
    assert events[1].cause == "world size 2 -> 1"
    # the driver's own record of that preemption (a node that died before its deadline) wins
    driver = Event("preemption", 25.0, 52, 1, "b", "its node died", "step-00000050", 2, True)
    merged = merge_events([driver], events, events)
    assert [(e.type, e.time) for e in merged] == [("resize", 20.0), ("preemption", 25.0)]
    assert merged[1] is driver and count_restarts(merged) == 1


def test_an_event_survives_its_json_record_and_older_records_are_read():
    event = Event("hang", 5.0, 14, 1, "10.0.0.7", "hang: x", "step-00000010", 4, True)
    assert Event.from_dict(event.to_dict()) == event
    assert Event.from_dict({**event.to_dict(), "later_field": 1}) == event  # a newer writer's extra key
    # a record from before "steps_lost" and "restarted": no steps counted, restarted if it names a checkpoint
    bare = Event.from_dict({"type": "failure", "time": 1.0, "step": 3, "rank": None, "node": None,
                            "cause": "lost", "from_checkpoint": None})
    assert dataclasses.astuple(bare)[-3:] == (0, False, None)
