"""Failures at the moments a real run meets them, each recorded once and rightly, and
each costing at most a step where the survivors could save: one run with an in-memory
snapshot every 4 steps whose worker group is SIGKILLed mid first epoch before any
checkpoint (rank 1, then rank 0, which dies copying a snapshot), during the first
epoch's validation (no survivor's save: the newest snapshot), past --max-failures, and
(the same command again) after a resume. Ray Train restarts the group within
--max-failures 3; the fourth loss ends the command with one line naming the lost rank and
the flag (what a run with no --max-failures says at its first loss:
tests/unit/test_restart_decision.py), and the same command again resumes from run storage.
Every failure is one event with its type, rank, node, step, the state the new group
loaded (a node's snapshot or survivor's save, a checkpoint, or none) and the steps it
redid, one console line as it happens and one more once the new group said it loaded a
node's snapshot; the metrics table holds every window of every rank once (a snapshot
carries the rows no report had sent); the run ends with the weights of a run that never
failed (test_train.py's full_run: the same toy, data and schedule). `ray-ddp runs` counts
the restarts.

(A hang at the same moments: test_hangs.py.)"""

from __future__ import annotations

import functools
import json
import os
import re

import pytest

from ray_ddp import TrainConfig, TrainingError, run
from ray_ddp.data.synth_files import write_synthetic
from ray_ddp.checkpoint.snapshots import run_key, snapshot_root
from ray_ddp.observe.runs import list_runs

from ._runs import final_hashes, rows_of, small

pytestmark = pytest.mark.ray

KILLS = (
    (1, "forward", 7),   # life 1: rank 1 in step 7: rank 0, its survivor, saves step 6
    (0, "write", 2),     # life 2 (from 6): rank 0 copying step 8's snapshot: rank 1 saves step 8
    (1, "validate", 2),  # life 3 (from 8): rank 1 validating epoch 1: no save; the newest, step 8's
    (0, "forward", 4),   # life 4 (from 8, step 10 checkpointed): rank 0 in step 12: the 4th loss ends it
    (1, "forward", 3),   # life 5, the same command again (resumed at step 10): rank 1 in step 13
)
# (rank, the state the new group loaded, whether from a node's memory) for each life's loss
LOADED = ((1, "step-00000006", True), (0, "step-00000008", True), (1, "step-00000008", True),
          (0, None, False))


def test_each_failure_moment_is_one_event_one_line_and_the_weights_of_a_run_that_never_failed(
        full_run, storage, tmp_path):
    from user_models import dies_on_schedule

    lines: list[str] = []
    model = functools.partial(dies_on_schedule, str(tmp_path / "lives"), KILLS)
    # validated every epoch on rows of its own (the training rows stay full_run's)
    write_synthetic(str(tmp_path / "val"), rows=64, features=10, targets=5, seed=9)
    # the default hang watch (small() turns it off): a lost group's step is what its heartbeats reached
    cfg = small(storage, "faults", max_failures=3, quiet=False, val_data=str(tmp_path / "val"),
                hang_timeout=TrainConfig.hang_timeout, snapshot_every_steps=4)
    with pytest.raises(TrainingError) as failed:
        run(cfg, echo=lines.append, model=model)
    assert re.fullmatch(r"rank 0 on node 127\.0\.0\.1 was lost \(its process \d+ died\)( at step \d+)?; "
                        r"--max-failures 3 restarts were spent: pass a larger --max-failures \(-1: no limit\) "
                        r"to let the run restart from its latest checkpoint", str(failed.value)), str(failed.value)
    [listing] = [r for r in list_runs(str(storage)) if r.name == "faults"]
    assert (listing.state, listing.restarts) == ("failed", 3)
    second = run(cfg, echo=lines.append, model=model)  # the same command again
    assert second.epochs_completed == 3

    events = second.events
    # the rerun resumes from the newest checkpoint in storage: step 10's, written by life 4
    # (uploaded while it trained on to step 12; were it not whole there, from scratch), and
    # its rank 1 dies 3 steps later: rank 0 saves the step before
    resumed = second.resumed_from
    assert resumed is None or resumed.endswith("/faults/step-00000010"), resumed
    start = 10 if resumed else 0
    loaded = LOADED + ((1, f"step-{start + 2:08d}", True),)
    told = [(e["type"], e["rank"], e["node"], e["from_checkpoint"], e["from_node"] is not None, e["restarted"])
            for e in events]
    assert told == [("failure", rank, "127.0.0.1", source, node, source is not None or rank != 0)
                    for rank, source, node in loaded], told
    # the last step any rank of the failed group finished, as far as the run knew (its
    # reports and its heartbeats between them: never more than the truth), and the steps
    # the new group redid from there: at most the one under way where a survivor saved
    for e, (low, high), most in zip(events, ((6, 7), (8, 9), (8, 10), (0, 12), (start + 2, start + 3)),
                                    (1, 1, 2, 0, 1)):
        assert (e["step"] is None or low <= e["step"] <= high) and e["steps_lost"] <= most, e
        if e["restarted"]:
            assert e["steps_lost"] == max(0, e["step"] - int(e["from_checkpoint"][5:])), e
        assert "its process" in e["cause"] and "died" in e["cause"], e
    said = [line for line in lines if line.startswith("failure after step") and "was lost" in line]
    assert len(said) == 4, lines  # the 4th loss is the command's error, not a line
    settled = [line for line in lines if line.startswith("failure after step") and "was lost" not in line]
    assert settled == [f"failure after step {e['step']}: restarted from the snapshot of step "
                       f"{int(e['from_checkpoint'][5:])} on node {e['from_node'][:8]}…"
                       + (f": {e['steps_lost']} step{'s' if e['steps_lost'] != 1 else ''} to redo"
                          if e["steps_lost"] else "")
                       for e in events if e["from_node"]], lines

    status = json.loads((storage / "faults" / "status.json").read_text())
    assert status["events"] == events and status["state"] == "complete"
    [listing] = [r for r in list_runs(str(storage)) if r.name == "faults"]
    assert listing.restarts == 4
    rows = rows_of(second)
    keys = [(r["step"], r["rank"]) for r in rows]
    assert sorted(keys) == sorted(set(keys)), "each (step, rank) once: a redone step replaces its first try"
    assert sorted(set(keys)) == [(step, rank) for step in range(5, 31, 5) for rank in (0, 1)], \
        "every window of every rank: the rows a snapshot carried were sent by the group that loaded it"
    assert final_hashes(rows) == final_hashes(rows_of(full_run))
    # each command's end drops the run's snapshots from the node: they are memory
    assert not os.path.exists(os.path.join(snapshot_root(), run_key(cfg.storage, cfg.name)))
