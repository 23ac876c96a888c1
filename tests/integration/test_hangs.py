"""A rank that stops answering, at the moments a real run meets it: the hang watch names
it, keeps every rank's stacks and flight recorder, ends the worker group, and the run
goes on from its latest checkpoint or from scratch, each hang one event and one line.
One run (--hang-timeout 10 --wait-timeout 20) whose rank 1 hangs in its first step, mid
first epoch before any checkpoint, during the first epoch's validation (before its
checkpoint) and after the first checkpoint (which itself takes longer than the timeout:
a meant wait, not a hang), and whose rank 0 hangs writing a checkpoint; then, resumed for
one more epoch by a second command, rank 1 after the resume. It ends with the weights of a run that never
hung (test_train.py's full_run: the same toy, data and schedule). The same run (one run
is cheaper than several on two cores) records a --profile trace of steps 3-5 on every
rank and is tracked in a real MLflow server. (Without --wait-timeout, a checkpoint gets
10 x --hang-timeout and a first step at least 30 min: tests/unit/test_hang_watch.py.)

Beside it, a third run (replaced-group): Ray Train restarts the worker group while the
watch still handles its hang, then the new group hangs too, and the watch catches that
second hang within --hang-timeout (it once retired the new group with the hung one)."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import time

import pytest

from ray_ddp import run
from ray_ddp.data.synth_files import write_synthetic

from ._runs import final_hashes, rows_of, run_in_thread, small, summary_of

pytestmark = pytest.mark.ray

HANGS = (
    (1, "forward", 1),    # life 1: rank 1 in its first step: from scratch, nothing to redo (after --wait-timeout)
    (1, "forward", 4),    # life 2: rank 1 in step 4, nothing saved yet: from scratch, 3 steps to redo
    (1, "validate", 10),  # life 3: rank 1 validating epoch 1, before its checkpoint: from scratch
    (1, "forward", 15),   # life 4: rank 1 in step 15, after step 10's (slow) checkpoint: from step-10
    (0, "write", 10),     # life 5 (from step 10): rank 0 writing step 20's checkpoint (after --wait-timeout)
    None,                 # life 6: ends the first command (2 epochs)
    (1, "forward", 3),    # life 7, the second command (resumed at step 20): rank 1 in step 23
)
# each hang: (step every rank finished, the checkpoint the new group loaded, steps redone)
TOLD = [(0, None, 0), (3, None, 3), (10, None, 10), (14, "step-00000010", 4), (20, "step-00000010", 10),
        (22, "step-00000020", 2)]
HUNG = [hang[0] for hang in HANGS if hang is not None]  # the rank that hung, each time
# the replaced-group run (1 epoch, from scratch each time: its first checkpoint is at step 10)
REPLACED = (
    (1, "forward", 4),  # life 1: rank 1 in step 4; the watch's write of its stacks stalls until life 2 reads
    (1, "forward", 3),  # life 2 (Ray Train's restart while the watch still handled life 1's hang): rank 1 in step 3
)                       # life 3: trains to the end


def hung_config(storage, val, epochs, mlflow_uri):
    # no in-memory snapshots: the story tells restarts from run storage (when the watch ends
    # a group, a rank it has not killed yet may save as a survivor: test_faults.py's story)
    return small(storage, "hung-rank", epochs=epochs, max_failures=5, hang_timeout=10, wait_timeout=20,
                 snapshot_every_steps=0,
                 profile="3-5", mlflow=mlflow_uri, val_data=val, quiet=False)


def start_hang_story(storage, folder, mlflow_uri):
    """Both commands, one after the other, in a thread (conftest.py's ``hang_story`` starts
    it with the first integration test: most of its minutes are the watch's waits, which
    the other tests fill). The first: five hangs under --hang-timeout 10 --wait-timeout 20
    (Ray's own health check would take minutes to notice a process that is alive), then 2
    epochs done; the second: resumed for a third epoch, with one more hang. Beside them,
    in a thread of its own, the replaced-group run (``result["replaced"]``)."""
    from user_models import hangs_on_schedule

    val = str(folder / "val")
    write_synthetic(val, rows=64, features=10, targets=5, seed=9)
    model = functools.partial(hangs_on_schedule, str(folder / "lives"), HANGS, 13.0)

    def tell() -> dict:
        try:
            return tell_both()
        finally:
            replaced[0].join(timeout=400)  # the replaced-group run too: conftest.py joins this thread

    def tell_both() -> dict:
        first: list[str] = []
        started = time.monotonic()
        summary = run(hung_config(storage, val, 2, mlflow_uri), echo=first.append, model=model)
        took = time.monotonic() - started
        status = json.loads((storage / "hung-rank" / "status.json").read_text())  # the second rewrites it
        second: list[str] = []
        cfg = dataclasses.replace(hung_config(storage, val, 3, mlflow_uri), max_failures=1)
        resumed = run(cfg, echo=second.append, model=model)
        return dict(summary=summary, lines=first, took=took, status=status, resumed=resumed, resumed_lines=second)

    replaced = start_replaced_story(storage, folder)  # beside the two commands: their waits fill each other's
    thread, result = run_in_thread(None, tell)
    result["replaced"] = replaced
    return thread, result


def start_replaced_story(storage, folder):
    """The replaced-group run (--hang-timeout 10 --wait-timeout 20), in a thread: its
    first hang's stacks are written to a named pipe (hang_models.py), a write that stalls
    until the group Ray Train started meanwhile (rank 0's collective timed out after
    --wait-timeout + --hang-timeout, 30 s) reads it; then that group's rank 1 hangs."""
    from hang_models import release_stalled_write, stalls_the_watch

    lives = folder / "replaced-lives"
    fifo = storage / "replaced-group" / "hangs" / "3" / "rank-0.txt"
    model = functools.partial(stalls_the_watch, str(lives), REPLACED, str(fifo))

    def tell() -> dict:
        lines: list[str] = []
        cfg = small(storage, "replaced-group", epochs=1, max_failures=3, hang_timeout=10, wait_timeout=20,
                    snapshot_every_steps=0,
                    quiet=False)
        try:
            summary = run(cfg, echo=lines.append, model=model)
        finally:
            release_stalled_write(str(fifo))
        read = lives / "read-stacks.txt"
        return dict(summary=summary, lines=lines, read=read.read_text() if read.exists() else None)

    return run_in_thread(None, tell)


@pytest.fixture(scope="module")
def story(hang_story):
    return summary_of(*hang_story)


@pytest.fixture(scope="module")
def replaced_story(hang_story):
    return summary_of(*hang_story[1]["replaced"])


def test_each_hang_is_named_and_the_run_restarts_from_its_checkpoint_or_from_scratch(story, storage):
    summary, lines, took = story["summary"], story["lines"], story["took"]
    assert summary.steps == 20 and summary.epochs_completed == 2
    # (a group that slept out its hang would take an hour: 3,600 s in user_models.py)
    assert took < 600, f"the run took {took:.0f} s: the watch did not end the hung groups"
    said = [x for x in lines if x.startswith("hang:")]
    assert len(said) == 5, lines
    assert all(f"after step {step}: " in line for line, (step, _, _) in zip(said, TOLD)), said
    for line, rank in zip(said, HUNG):
        assert f"not in a collective: rank {rank} on node 127.0.0.1 at user_models.py:" in line, line
        assert f"rank {1 - rank} waits in one" in line, line
    assert all("in _die" in line for line in said), said  # the sleeping frame (user_models.py)
    assert f"stacks in {storage}/hung-rank/hangs/14/" in said[3], said
    events = summary.events
    assert [e["type"] for e in events] == ["hang"] * 5, events
    for e, (step, loaded, lost), rank in zip(events, TOLD, HUNG):
        assert (e["rank"], e["node"], e["step"]) == (rank, "127.0.0.1", step), e
        assert (e["from_checkpoint"], e["steps_lost"], e["restarted"]) == (loaded, lost, True), e
    # the line after each: where the new group started and what it redid, told as the
    # hang's (Ray Train saw only the processes the watch killed), never as a lost rank;
    # a hang in the first step leaves nothing to redo
    restarts = [x for x in lines if re.match(r"(hang|failure) after step", x)]
    assert restarts == [f"hang after step {step}: Ray Train restarted the worker group the hang watch ended "
                        f"(within --max-failures); restarted from {loaded or 'scratch'}"
                        + (f": {lost} steps to redo" if lost else "")
                        for step, loaded, lost in TOLD[:5]], lines
    assert story["status"]["events"] == summary.events


def test_the_hung_ranks_stack_shows_the_sleeping_frame(story, storage):
    folder = storage / "hung-rank" / "hangs" / "14"
    hung, waiting = (folder / "rank-1.txt").read_text(), (folder / "rank-0.txt").read_text()
    assert hung.startswith("rank 1: NOT in a collective, at user_models.py:") and "time.sleep(3600)" in hung
    assert waiting.startswith("rank 0: waiting in a collective") and "backward" in waiting


def test_each_ranks_flight_recorder_shows_who_the_collective_waits_for(story, storage):
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
    # the first collectives ran under the start-up's timeout (the watch's --wait-timeout for
    # a first step and its handling: 20 + 10 + 120 s), those after the first step under
    # --wait-timeout + --hang-timeout: the watch acts first, the process group's timeout is
    # the backstop
    timeouts = [e["timeout_ms"] for e in record[0]["entries"]]
    assert timeouts[0] == 150_000 and timeouts[-1] == 30_000 and set(timeouts) == {150_000, 30_000}


def test_profile_writes_a_chrome_trace_of_the_steps_on_every_rank(story, storage):
    summary = story["summary"]
    assert summary.profile == f"{storage}/hung-rank/profile"
    for rank in (0, 1):
        trace = json.loads((storage / "hung-rank" / "profile" / f"rank-{rank}.pt.trace.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        steps = {n for n in names if n.startswith("ProfilerStep#")}
        assert len(steps) == 3, steps  # steps 3, 4 and 5, each marked
        assert any("addmm" in n for n in names) and any("allreduce" in n.lower() for n in names)


def test_a_hang_after_a_resume_and_mlflow_holds_both_commands_once(story, storage, mlflow_uri, full_run):
    from mlflow.tracking import MlflowClient

    resumed, lines = story["resumed"], story["resumed_lines"]
    assert resumed.steps == 30 and resumed.resumed_from.endswith("step-00000020")
    [said] = [x for x in lines if x.startswith("hang:")]
    assert "after step 22" in said and "not in a collective: rank 1" in said, said
    hangs = [e for e in resumed.events if e["type"] == "hang"]
    assert [(e["step"], e["from_checkpoint"], e["steps_lost"]) for e in hangs] == TOLD, hangs
    # six hangs, each restarted from scratch or a checkpoint: the weights of a run that never hung
    rows = rows_of(resumed)
    keys = [(r["step"], r["rank"]) for r in rows]
    assert sorted(keys) == sorted(set(keys)), "each (step, rank) once: a redone step replaces its first try"
    assert final_hashes(rows) == final_hashes(rows_of(full_run))

    client = MlflowClient(mlflow_uri)
    [exp] = [e for e in client.search_experiments() if e.name == "ray_ddp"]
    [mlrun] = [r for r in client.search_runs([exp.experiment_id]) if r.info.run_name == "hung-rank"]
    assert mlrun.info.status == "FINISHED"  # one MLflow run for both commands
    assert mlrun.data.params["workers"] == "2" and mlrun.data.params["hang_timeout"] == "10"
    assert mlrun.data.tags["ray_ddp.param_changed.epochs"] == "was 2, now 3"
    loss = client.get_metric_history(mlrun.info.run_id, "loss")
    assert sorted(m.step for m in loss) == [5, 10, 15, 20, 25, 30]  # every window once, redone ones too
    # found by the run folder's own id, not its name
    status = json.loads((storage / "hung-rank" / "status.json").read_text())
    assert mlrun.data.tags["ray_ddp.run_id"] == status["run_id"] and len(status["run_id"]) == 32
    rows = [r for r in json.loads((storage / "hung-rank" / "summary.json").read_text())["events"]]
    assert [e["type"] for e in json.loads(mlrun.data.tags["ray_ddp.events"])] == [e["type"] for e in rows]
    assert [m.step for m in client.get_metric_history(mlrun.info.run_id, "events.hang")] == [0, 3, 10, 14, 20, 22]
    assert client.get_metric_history(mlrun.info.run_id, "summary.final_loss")[-1].value == \
        pytest.approx(resumed.final_loss)
    assert [a.path for a in client.list_artifacts(mlrun.info.run_id, "model")] == ["model/model.pt"]


def test_a_group_ray_restarts_during_a_hangs_handling_is_watched_and_its_hang_caught(replaced_story, storage):
    summary, lines = replaced_story["summary"], replaced_story["lines"]
    said = [x for x in lines if x.startswith("hang:")]
    assert len(said) == 2, lines
    first, second = said
    assert "after step 3: not in a collective: rank 1 on node 127.0.0.1 at " in first and "rank 0 waits in one" in first
    assert f"stacks in {storage}/replaced-group/hangs/3/" in first
    # Ray Train restarted the group (rank 0's collective timed out) while the watch's write
    # of the stacks stalled: its restart is told before the hang's own line, as the hang's
    restarted = [i for i, x in enumerate(lines) if x.startswith("hang after step 3: Ray Train restarted")]
    assert restarted and restarted[0] < lines.index(first), lines
    # the stalled write went on once the new group read it: the hung group's stacks, not the new one's
    assert replaced_story["read"].startswith("rank 0: waiting in a collective"), replaced_story["read"]
    # the new group was watched on: its own hang caught after --hang-timeout (10 s), not
    # ended by its collective's timeout (30 s) as a failure
    assert "after step 2: not in a collective: rank 1 on node 127.0.0.1 at " in second and \
        "rank 0 waits in one" in second, second
    waited = int(re.search(r"for (\d+) s after", second).group(1))
    assert 10 <= waited < 20, second
    assert not [x for x in lines if x.startswith("warning: the hang watch")], lines
    assert summary.steps == 10
    assert [(e["type"], e["step"], e["rank"], e["from_checkpoint"]) for e in summary.events] == \
        [("hang", 3, 1, None), ("hang", 2, 1, None)], summary.events
