"""Failures at the moments a real run meets them, each recorded once and rightly: one
run whose worker group is SIGKILLed at its first step, mid first epoch before any
checkpoint, during the first epoch's validation (before its checkpoint), during a
checkpoint, and (a second command) after a resume. Ray Train
restarts the group each time (--max-failures); every failure is one event with its type,
rank, node, step, the checkpoint the new group loaded (or none: from scratch) and the
steps it redid, one console line, and the run ends with the weights of a run that never
failed (test_train.py's full_run: the same toy, data and schedule). `ray-ddp runs`
counts the restarts.

(A hang at the same moments: test_hangs.py.)"""

from __future__ import annotations

import functools
import json
import re

import pytest

from ray_ddp import run
from ray_ddp.data.synth_files import write_synthetic
from ray_ddp.observe.runs import list_runs

from ._runs import final_hashes, rows_of, small

pytestmark = pytest.mark.ray

KILLS = (
    (1, "forward", 1),   # life 1: rank 1 at its first step; nothing saved: from scratch
    (1, "forward", 7),   # life 2: rank 1 at step 7, after the report of step 5: from scratch
    (1, "validate", 10),  # life 3: rank 1 validating epoch 1, before its checkpoint: from scratch
    (0, "write", 20),    # life 4: rank 0 writing step 20's checkpoint: from step-10
    None,                # life 5: ends the first command (2 epochs)
    (1, "forward", 3),   # life 6, the second command (resumed at step 20): rank 1 at step 23
)


def test_each_failure_moment_is_one_event_one_line_and_the_weights_of_a_run_that_never_failed(
        full_run, storage, tmp_path):
    from user_models import dies_on_schedule

    lines: list[str] = []
    model = functools.partial(dies_on_schedule, str(tmp_path / "lives"), KILLS)
    # validated every epoch on rows of its own (the training rows stay full_run's)
    write_synthetic(str(tmp_path / "val"), rows=64, features=10, targets=5, seed=9)
    common = dict(max_failures=4, quiet=False, val_data=str(tmp_path / "val"))
    first = run(small(storage, "faults", epochs=2, **common), echo=lines.append, model=model)
    assert first.epochs_completed == 2
    second = run(small(storage, "faults", epochs=3, **common), echo=lines.append, model=model)
    assert second.epochs_completed == 3 and second.resumed_from.endswith("/faults/step-00000020")

    events = second.events
    told = [(e["type"], e["rank"], e["node"], e["from_checkpoint"], e["restarted"], e["step"], e["cause"])
            for e in events]
    # In step 20's checkpoint, step 10's (written asynchronously) may not have reached Ray
    # Train yet on a loaded machine: then it was never committed, the new group starts
    # from scratch, and the event must say so. Either way the event tells what happened.
    third = events[3]["from_checkpoint"] if len(events) == 5 else None
    assert third in (None, "step-00000010"), told
    assert [t[:5] for t in told] == [
        ("failure", 1, "127.0.0.1", None, True),
        ("failure", 1, "127.0.0.1", None, True),
        ("failure", 1, "127.0.0.1", None, True),
        ("failure", 0, "127.0.0.1", third, True),
        ("failure", 1, "127.0.0.1", "step-00000020", True),
    ], told
    # the last step any rank of the failed group finished, as far as the run knew (its
    # reports, which go out in batches, and its heartbeats between them: never more than
    # the truth, never an earlier group's), and the steps the new group redid from there
    since = (0, 0, 0, 10 if third else 0, 20)
    bounds = ((0, 0), (0, 6), (0, 10), (10 if third else 0, 20), (20, 22))
    for e, start, (low, high) in zip(events, since, bounds):
        assert low <= e["step"] <= high and e["steps_lost"] == e["step"] - start, e
        assert "was lost (its process" in e["cause"] and "--max-failures" in e["cause"], e
    said = [line for line in lines if line.startswith("failure after step")]
    assert len(said) == 5, lines
    for line, e in zip(said, events):
        where = f"restarted from {e['from_checkpoint'] or 'scratch'}"
        assert re.match(rf"failure after step {e['step']}: rank {e['rank']} was lost .*; {where}", line), line

    status = json.loads((storage / "faults" / "status.json").read_text())
    assert status["events"] == events
    [listing] = [r for r in list_runs(str(storage)) if r.name == "faults"]
    assert listing.restarts == 5
    rows = rows_of(second)
    keys = [(r["step"], r["rank"]) for r in rows]
    assert sorted(keys) == sorted(set(keys)), "each (step, rank) once: a redone step replaces its first try"
    assert final_hashes(rows) == final_hashes(rows_of(full_run))
