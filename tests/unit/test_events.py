"""A run's events without Ray: a lost worker's record, what the metrics table adds
(preemption checkpoints, resizes), merging them once each, and the restarts column."""

from ray_ddp.driver.events import count_restarts, failure_event, merge_events, table_events
from ray_ddp.driver.failures import FailureSummary


def test_a_lost_worker_is_recorded_with_every_field():
    lost = FailureSummary(1, "10.0.0.7", "process", "its process 7 died", node_id="b")
    event = failure_event(lost, 37, "step-00000020", 20, preemption=False)
    assert {k: event[k] for k in ("type", "step", "rank", "node", "cause", "from_checkpoint", "steps_lost")} == {
        "type": "failure", "step": 37, "rank": 1, "node": "10.0.0.7", "cause": "its process 7 died",
        "from_checkpoint": "step-00000020", "steps_lost": 17}
    assert failure_event(lost, 37, None, 20, preemption=False)["steps_lost"] == 0  # the run stopped


def test_the_table_adds_preemptions_and_resizes_and_each_is_kept_once():
    rows = [{"step": 40, "rank": 0, "time": 10.0, "preempted_node": None},
            {"step": 50, "rank": 0, "time": 20.0, "preempted_node": "b"},
            {"step": 60, "rank": 0, "time": 30.0, "preempted_node": None}]
    stretches = [{"world_size": 2, "from_step": 0, "to_step": 50}, {"world_size": 1, "from_step": 50, "to_step": 60}]
    events = table_events(rows, stretches)
    assert [(e["type"], e["step"], e["from_checkpoint"]) for e in events] == [
        ("preemption", 50, "step-00000050"), ("resize", 50, None)]
    assert events[1]["cause"] == "world size 2 -> 1"
    # the driver's own record of that preemption (a node that died before its deadline) wins
    driver = {"type": "preemption", "time": 25.0, "step": 52, "rank": 1, "node": "b", "cause": "its node died",
              "from_checkpoint": "step-00000050", "steps_lost": 2}
    merged = merge_events([driver], events, events)
    assert [(e["type"], e["time"]) for e in merged] == [("resize", 20.0), ("preemption", 25.0)]
    assert count_restarts(merged) == 1
