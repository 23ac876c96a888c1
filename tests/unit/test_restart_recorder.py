"""The restart recorder without a cluster: Ray Train's own status and decision types fed
to its hooks in the order the controller calls them (a group starts, a poll finds a dead
rank, the failure policy decides), and what lands in progress.json. The hooks' wiring
into a real controller is tests/integration/test_faults.py's story (four restarts, and a
loss that ends a command); their names and signatures in this Ray are
tests/unit/test_ray_hooks.py's."""

from __future__ import annotations

import json

from ray.exceptions import ActorDiedError
from ray.train.v2._internal.execution.context import DistributedContext
from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus, WorkerStatus
from ray.train.v2._internal.execution.worker_group.worker import ActorMetadata, Worker

from ray_ddp.record.progress import format_event
from ray_ddp.observe.callback import MetricsCallback
from ray_ddp.observe.ray_hooks import FailureDecision
from ray_ddp.observe.restarts import RestartRecorder
from ray_ddp.record.folder import run_folder
from ray_ddp.storage import resolve_storage


class StartedGroup:
    """What after_worker_group_start reads of Ray Train's WorkerGroup: its workers."""

    def __init__(self, workers):
        self.workers = workers

    def get_workers(self):
        return self.workers


def group(ips):
    return StartedGroup([
        Worker(actor=None, metadata=ActorMetadata(hostname=f"h{r}", node_id=f"node{r}" * 8, node_ip=ip, pid=100 + r,
                                                  accelerator_ids={}), resources={},
               distributed_context=DistributedContext(world_rank=r, world_size=len(ips), local_rank=r,
                                                      local_world_size=len(ips), node_rank=r))
        for r, ip in enumerate(ips)])


def dead(rank):
    return WorkerGroupPollStatus({0: WorkerStatus(running=True), rank: WorkerStatus(running=False, error=ActorDiedError())})


def fit_metrics(tmp_path):
    """A fit's MetricsCallback, its run folder made (the driver writes status.json there first)."""
    (tmp_path / "r").mkdir()
    return MetricsCallback(run_folder(resolve_storage(str(tmp_path)), "r"), epochs=2, total_steps=40)


def progress(tmp_path, name="r"):
    return json.loads((tmp_path / name / "progress.json").read_text())


def test_a_rank_lost_before_any_report_is_recorded_with_its_node_and_scratch(tmp_path):
    metrics = fit_metrics(tmp_path)
    recorder = RestartRecorder(metrics)
    recorder.after_worker_group_start(group(["10.0.0.1", "10.0.0.2"]))
    assert progress(tmp_path)["nodes"] == {"0": "node0" * 8, "1": "node1" * 8}  # known before a report
    recorder.after_worker_group_poll_status(dead(1))
    recorder.after_worker_group_poll_status(dead(1))  # the next poll sees the same failure
    recorder.before_controller_execute_failure_decision(FailureDecision.RETRY)
    [event] = progress(tmp_path)["events"]
    assert (event["type"], event["rank"], event["node"], event["from_checkpoint"], event["restarted"]) == \
        ("failure", 1, "10.0.0.2", None, True)
    assert "rank 1 was lost" in event["cause"] and "--max-failures" in event["cause"]
    # the new group's first report does not record the same restart again: it settles it,
    # from where its rank 0 resumed (here a node's snapshot, newer than any checkpoint)
    recorder.after_worker_group_start(group(["10.0.0.1", "10.0.0.3"]))
    metrics._groups.note_restart([{"started_at": 1.0, "rank": 1, "resumed_at": 0},
                                  {"started_at": 1.0, "rank": 0, "resumed_at": 3, "resumed_from": "step-00000003",
                                   "resumed_from_node": "5d1e0000"}],
                                 metrics._last_step, (None, 0), metrics.preempted_at)
    [settled] = metrics._groups.events
    assert (settled.from_checkpoint, settled.from_node, settled.steps_lost) == \
        ("step-00000003", "5d1e0000", max(0, settled.step - 3))
    assert "restarted from the snapshot of step 3 on node 5d1e0000" in format_event(settled)


def test_a_resumed_fit_restarts_from_the_checkpoint_it_began_with(tmp_path):
    metrics = fit_metrics(tmp_path)
    recorder = RestartRecorder(metrics, resumed_from="step-00000020")
    recorder.after_worker_group_start(group(["10.0.0.1", "10.0.0.2"]))
    metrics._group_step = 27  # this group reported step 27, and saved no checkpoint yet
    recorder.after_worker_group_poll_status(dead(0))
    recorder.before_controller_execute_failure_decision(FailureDecision.RETRY)
    [event] = progress(tmp_path)["events"]
    assert (event["rank"], event["step"], event["from_checkpoint"], event["steps_lost"]) == (0, 27, "step-00000020", 7)


def test_a_failure_ray_does_not_retry_is_left_to_the_driver_with_its_last_step(tmp_path):
    metrics = fit_metrics(tmp_path)
    recorder = RestartRecorder(metrics, resumed_from="step-00000010")
    recorder.after_worker_group_start(group(["10.0.0.1", "10.0.0.2"]))
    metrics._group_step = 17  # what the group's reports (or heartbeats) reached
    recorder.after_worker_group_poll_status(dead(1))
    recorder.before_controller_execute_failure_decision(FailureDecision.RAISE)
    assert not progress(tmp_path).get("events") and metrics._groups.events == []
    # the driver's line ("... was lost ... at step 17") reads the step from progress.json
    assert progress(tmp_path)["step"] == 17


def test_a_hook_that_fails_never_fails_the_run():
    recorder = RestartRecorder(metrics=None)  # every record it tries to keep raises
    recorder.after_worker_group_start(group(["10.0.0.1"]))
    recorder.after_worker_group_poll_status(dead(0))
    recorder.before_controller_execute_failure_decision(FailureDecision.RETRY)


def test_a_group_resumed_from_a_nodes_snapshot_settles_its_restart_before_any_window(tmp_path):
    """The new group's words before its first step (a report without rows): the restart's
    event takes the snapshot it loaded, its node, and the step the failed group reached at
    least (it wrote that snapshot), in progress.json at once; the driver says it again."""
    from ray_ddp.record.events import from_records
    from ray_ddp.record.progress import format_settled

    metrics = fit_metrics(tmp_path)
    recorder = RestartRecorder(metrics)
    recorder.after_worker_group_start(group(["10.0.0.1", "10.0.0.2"]))
    recorder.after_worker_group_poll_status(dead(1))
    recorder.before_controller_execute_failure_decision(FailureDecision.RETRY)
    [told] = progress(tmp_path)["events"]
    assert (told["step"], told["from_checkpoint"], told["from_node"]) == (0, None, None)  # what it knew
    recorder.after_worker_group_start(group(["10.0.0.1", "10.0.0.2"]))
    started = {"rank": 0, "resumed_at": 6, "resumed_from": "step-00000006", "resumed_from_node": "5d1e" * 10}
    metrics.after_report(None, [{"group_started": started}, {"group_started": {**started, "rank": 1}}], None)
    [event] = progress(tmp_path)["events"]
    assert (event["step"], event["from_checkpoint"], event["from_node"], event["steps_lost"]) == \
        (6, "step-00000006", "5d1e" * 10, 0)
    assert not (tmp_path / "r" / "metrics.parquet").exists()  # no rows: nothing written but progress
    [settled] = from_records([event])
    assert format_settled(settled) == "failure after step 6: restarted from the snapshot of step 6 on node 5d1e5d1e…"


def test_an_elastic_restart_from_a_snapshot_of_more_ranks_keeps_its_rows_and_resizes_after_its_step(tmp_path):
    """A group of 2 loses a node; the group of 1 that follows resumes from the survivor's
    save of step 12 (2 ranks' state), whose unsent rows (step 10's window, both ranks)
    its rank 0 sends whole before its first step: they are in the table at once, before
    the new group's rows, the restart is settled by the snapshot, and the resize said
    after the old world's last window (step 10), where the table's stretches put it."""
    from ray_ddp.record.metrics_table import read_metrics

    def row(step, rank, world, **extra):
        return {"epoch": 1, "step": step, "rank": rank, "loss": 1.0, "samples": 8, "step_time_s": 0.1,
                "samples_per_s": 80.0, "time": 1.0 + step, "busy_s": 0.05, "world_size": world, **extra}

    metrics = fit_metrics(tmp_path)
    recorder = RestartRecorder(metrics)
    recorder.after_worker_group_start(group(["10.0.0.1", "10.0.0.2"]))
    metrics.after_report(None, [row(5, 0, 2, started_at=1.0), row(5, 1, 2, started_at=1.0)], None)
    recorder.after_worker_group_poll_status(dead(1))
    recorder.before_controller_execute_failure_decision(FailureDecision.RETRY)
    recorder.after_worker_group_start(group(["10.0.0.1"]))
    started = {"rank": 0, "resumed_at": 12, "resumed_from": "step-00000012", "resumed_from_node": "node0" * 8,
               "carried": [[row(10, 0, 2), row(10, 1, 2)]]}
    metrics.after_report(None, [{"group_started": started}], None)
    folder = run_folder(resolve_storage(str(tmp_path)), "r")
    assert [(r["step"], r["rank"]) for r in read_metrics(folder).to_pylist()] == [(5, 0), (5, 1), (10, 0), (10, 1)]
    metrics.after_report(None, [row(15, 0, 1, started_at=2.0, resumed_at=12)], None)
    assert [(r["step"], r["rank"], r["world_size"]) for r in read_metrics(folder).to_pylist()] == \
        [(5, 0, 2), (5, 1, 2), (10, 0, 2), (10, 1, 2), (15, 0, 1)]
    failure, resize = progress(tmp_path)["events"]
    assert (failure["step"], failure["from_checkpoint"], failure["from_node"], failure["steps_lost"]) == \
        (12, "step-00000012", "node0" * 8, 0)
    assert (resize["type"], resize["step"], resize["cause"]) == ("resize", 10, "world size 2 -> 1")
