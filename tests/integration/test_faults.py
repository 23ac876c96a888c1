"""Failures at the moments a real run meets them, each recorded once and rightly: one
run whose worker group is SIGKILLed at its first step, mid first epoch before any
checkpoint, during the first epoch's validation (before its checkpoint), during a
checkpoint, past --max-failures, and (the same command again) after a resume. Ray Train
restarts the group within --max-failures 3; the fourth loss ends the command with one
line naming the lost rank and the flag (what a run with no --max-failures says at its
first loss: tests/unit/test_restart_decision.py), and the same command again resumes.
Every failure is one event with its type, rank, node, step, the checkpoint the new group
loaded (or none: from scratch, or not restarted) and the steps it redid, one console
line, and the run ends with the weights of a run that never failed (test_train.py's
full_run: the same toy, data and schedule). `ray-ddp runs` counts the restarts.

(A hang at the same moments: test_hangs.py.)"""

from __future__ import annotations

import functools
import json
import re

import pytest

from ray_ddp import TrainConfig, TrainingError, run
from ray_ddp.data.synth_files import write_synthetic
from ray_ddp.observe.runs import list_runs

from ._runs import final_hashes, rows_of, small

pytestmark = pytest.mark.ray

KILLS = (
    (1, "forward", 1),   # life 1: rank 1 at its first step; nothing saved: from scratch
    (1, "forward", 7),   # life 2: rank 1 at step 7, after the report of step 5: from scratch
    (1, "validate", 10),  # life 3: rank 1 validating epoch 1, before its checkpoint: from scratch
    (0, "write", 20),    # life 4: rank 0 writing step 20's checkpoint: the 4th loss ends the command
    (1, "forward", 3),   # life 5, the same command again (resumed at step 10): rank 1 at step 13
)


def test_each_failure_moment_is_one_event_one_line_and_the_weights_of_a_run_that_never_failed(
        full_run, storage, tmp_path):
    from user_models import dies_on_schedule

    lines: list[str] = []
    model = functools.partial(dies_on_schedule, str(tmp_path / "lives"), KILLS)
    # validated every epoch on rows of its own (the training rows stay full_run's)
    write_synthetic(str(tmp_path / "val"), rows=64, features=10, targets=5, seed=9)
    # the default hang watch (small() turns it off): a lost group's step is what its heartbeats reached
    cfg = small(storage, "faults", max_failures=3, quiet=False, val_data=str(tmp_path / "val"),
                hang_timeout=TrainConfig.hang_timeout)
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
    told = [(e["type"], e["rank"], e["node"], e["from_checkpoint"], e["restarted"], e["step"], e["cause"])
            for e in events]
    # the rerun resumes from the newest checkpoint in storage: step 10's, written by life 4
    # (uploaded while it trained on to step 20; were it not whole there, from scratch)
    resumed = second.resumed_from
    assert resumed is None or resumed.endswith("/faults/step-00000010"), resumed
    again = "step-00000010" if resumed else None
    assert [t[:5] for t in told] == [
        ("failure", 1, "127.0.0.1", None, True),
        ("failure", 1, "127.0.0.1", None, True),
        ("failure", 1, "127.0.0.1", None, True),
        ("failure", 0, "127.0.0.1", None, False),
        ("failure", 1, "127.0.0.1", again, True),
    ], told
    # the last step any rank of the failed group finished, as far as the run knew (its
    # reports, which go out in batches, and its heartbeats between them: never more than
    # the truth, never an earlier group's), and the steps the new group redid from there
    # (none counted for the group that was not restarted, whose step is unknown when it
    # died before its first report reached the driver and its heartbeats said no more)
    start = 10 if resumed else 0
    for e, since, (low, high) in zip(events, (0, 0, 0, None, start),
                                     ((0, 0), (0, 6), (0, 10), (0, 20), (start, start + 2))):
        if e["restarted"]:
            assert low <= e["step"] <= high and e["steps_lost"] == e["step"] - since, e
        else:
            assert (e["step"] is None or low <= e["step"] <= high) and e["steps_lost"] == 0, e
        assert "its process" in e["cause"] and "died" in e["cause"], e
    said = [line for line in lines if line.startswith("failure after step")]
    assert len(said) == 4, lines
    for line, e in zip(said, events[:3] + events[4:]):
        where = f"restarted from {e['from_checkpoint'] or 'scratch'}"
        assert re.match(rf"failure after step {e['step']}: rank {e['rank']} was lost .*; {where}", line), line

    status = json.loads((storage / "faults" / "status.json").read_text())
    assert status["events"] == events and status["state"] == "complete"
    [listing] = [r for r in list_runs(str(storage)) if r.name == "faults"]
    assert listing.restarts == 4
    rows = rows_of(second)
    keys = [(r["step"], r["rank"]) for r in rows]
    assert sorted(keys) == sorted(set(keys)), "each (step, rank) once: a redone step replaces its first try"
    assert final_hashes(rows) == final_hashes(rows_of(full_run))
