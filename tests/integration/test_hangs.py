"""A rank that stops answering: the hang watch names it, keeps every rank's stacks,
ends the worker group and the run goes on from its checkpoint. The same run (one run
is cheaper than three on two cores) records a --profile trace of steps 3-5 on every
rank and is tracked in a real MLflow server, then resumed for one more epoch."""

from __future__ import annotations

import functools
import json
import time

import pytest

from ray_ddp import TrainConfig, run

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def hung_run(ray_local, storage, tmp_path_factory, mlflow_uri):
    """Rank 1 sleeps in its 15th forward (first life only), under --hang-timeout 10;
    Ray's own health check would take minutes to notice a process that is alive. Before
    that, the first checkpoint (step 10) takes 13 s on rank 0, longer than the timeout:
    a meant wait, which must not be taken for a hang (one hang event, at step 14)."""
    from user_models import hangs_on_rank_one

    marker = tmp_path_factory.mktemp("hang") / "hung"
    lines: list[str] = []
    started = time.monotonic()
    summary = run(TrainConfig(workers=2, epochs=2, steps_per_epoch=10, batch_size=16, report_every=5,
                              max_failures=1, hang_timeout=10, profile="3-5", mlflow=mlflow_uri,
                              storage=str(storage),
                              name="hung-rank", quiet=True),
                  echo=lines.append, model=functools.partial(hangs_on_rank_one, str(marker), 15, 13.0))
    return summary, lines, time.monotonic() - started


def test_a_hung_rank_is_named_and_the_run_restarts_from_its_checkpoint(hung_run, storage):
    summary, lines, took = hung_run
    assert summary.steps == 20 and summary.epochs_completed == 2
    assert took < 150, f"the run took {took:.0f} s: the watch did not end the hung group"
    [line] = [x for x in lines if x.startswith("hang:")]
    assert "after step 14" in line and "not in a collective: rank 1 on node 127.0.0.1 at user_models.py:" in line, line
    assert "in forward" in line and "rank 0 waits in one" in line, line
    assert f"stacks in {storage}/hung-rank/hangs/14/" in line, line
    [event] = [e for e in summary.events if e["type"] == "hang"]
    assert (event["rank"], event["node"], event["step"]) == (1, "127.0.0.1", 14)
    assert (event["from_checkpoint"], event["steps_lost"]) == ("step-00000010", 4)
    assert not [e for e in summary.events if e["type"] == "failure"], summary.events
    status = json.loads((storage / "hung-rank" / "status.json").read_text())
    assert status["events"] == summary.events


def test_the_hung_ranks_stack_shows_the_sleeping_frame(hung_run, storage):
    folder = storage / "hung-rank" / "hangs" / "14"
    hung, waiting = (folder / "rank-1.txt").read_text(), (folder / "rank-0.txt").read_text()
    assert hung.startswith("rank 1: NOT in a collective, at user_models.py:") and "time.sleep(3600)" in hung
    assert waiting.startswith("rank 0: waiting in a collective") and "backward" in waiting


def test_each_ranks_flight_recorder_shows_who_the_collective_waits_for(hung_run, storage):
    folder = storage / "hung-rank" / "hangs" / "14"
    record = {rank: json.loads((folder / f"rank-{rank}.collectives.json").read_text()) for rank in (0, 1)}
    status = {rank: record[rank]["pg_status"]["0"] for rank in (0, 1)}
    enqueued = {rank: int(status[rank]["last_enqueued_collective"]) for rank in (0, 1)}
    # rank 0 enqueued the step's gradient all-reduce, which rank 1 (asleep in its forward)
    # never joined: rank 0's record is one ahead, and that collective is not done
    assert enqueued[0] == enqueued[1] + 1, status
    assert int(status[0]["last_completed_collective"]) < enqueued[0], status
    assert int(status[1]["last_completed_collective"]) == enqueued[1], status
    assert f"collective {enqueued[0]} enqueued" in (folder / "rank-0.txt").read_text()
    assert "not done" in (folder / "rank-0.txt").read_text() and "not done" not in (folder / "rank-1.txt").read_text()
    # the first collectives ran under Ray Train's 30 min, those after the first step under
    # 11 x --hang-timeout: the watch acts first, the process group's timeout is the backstop
    timeouts = [e["timeout_ms"] for e in record[0]["entries"]]
    assert timeouts[0] == 1_800_000 and timeouts[-1] == 110_000 and set(timeouts) == {1_800_000, 110_000}


def test_profile_writes_a_chrome_trace_of_the_steps_on_every_rank(hung_run, storage):
    summary, _, _ = hung_run
    assert summary.profile == f"{storage}/hung-rank/profile"
    for rank in (0, 1):
        trace = json.loads((storage / "hung-rank" / "profile" / f"rank-{rank}.pt.trace.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        steps = {n for n in names if n.startswith("ProfilerStep#")}
        assert len(steps) == 3, steps  # steps 3, 4 and 5, each marked
        assert any("addmm" in n for n in names) and any("allreduce" in n.lower() for n in names)


def test_mlflow_holds_the_run_and_a_resume_continues_it(hung_run, storage, mlflow_uri):
    from mlflow.tracking import MlflowClient
    from user_models import hangs_on_rank_one

    summary, _, _ = hung_run
    marker = storage / "hung-rank-marker"
    marker.touch()  # no hang this time
    resumed = run(TrainConfig(workers=2, epochs=3, steps_per_epoch=10, batch_size=16, report_every=5,
                              max_failures=1, hang_timeout=10, mlflow=mlflow_uri, storage=str(storage),
                              name="hung-rank", quiet=True),
                  model=functools.partial(hangs_on_rank_one, str(marker), 15))
    assert resumed.steps == 30 and resumed.resumed_from.endswith("step-00000020")
    client = MlflowClient(mlflow_uri)
    [exp] = [e for e in client.search_experiments() if e.name == "ray_ddp"]
    [mlrun] = client.search_runs([exp.experiment_id])  # one MLflow run for both commands
    assert mlrun.info.run_name == "hung-rank" and mlrun.info.status == "FINISHED"
    assert mlrun.data.params["workers"] == "2" and mlrun.data.params["hang_timeout"] == "10"
    assert mlrun.data.tags["ray_ddp.param_changed.epochs"] == "was 2, now 3"
    loss = client.get_metric_history(mlrun.info.run_id, "loss")
    assert sorted(m.step for m in loss) == [5, 10, 15, 20, 25, 30]  # every window once, both commands
    # found by the run folder's own id, not its name
    status = json.loads((storage / "hung-rank" / "status.json").read_text())
    assert mlrun.data.tags["ray_ddp.run_id"] == status["run_id"] and len(status["run_id"]) == 32
    rows = [r for r in json.loads((storage / "hung-rank" / "summary.json").read_text())["events"]]
    assert [e["type"] for e in json.loads(mlrun.data.tags["ray_ddp.events"])] == [e["type"] for e in rows]
    assert [m.step for m in client.get_metric_history(mlrun.info.run_id, "events.hang")] == [14]
    assert client.get_metric_history(mlrun.info.run_id, "summary.final_loss")[-1].value == \
        pytest.approx(resumed.final_loss)
    assert [a.path for a in client.list_artifacts(mlrun.info.run_id, "model")] == ["model/model.pt"]
