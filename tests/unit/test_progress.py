"""Progress output and straggler detection, on real files (no Ray)."""

import io
import json
import time
from contextlib import redirect_stdout

from ray_ddp.observe.stragglers import StragglerState
from ray_ddp.record.progress import read_progress, show_progress
from ray_ddp.record.folder import Progress, RunFolder
from ray_ddp.storage import resolve_storage, write_json


def report(step, busy):
    return [{"rank": r, "step": step, "busy_s": b, "node_id": f"node{r}"} for r, b in enumerate(busy)]


def test_straggler_needs_three_slow_reports_in_a_row():
    state = StragglerState()
    assert state.update(report(5, [0.1, 0.1, 0.5])) is None
    assert state.update(report(10, [0.1, 0.1, 0.5])) is None
    assert state.update(report(15, [0.1, 0.1, 0.1])) is None  # streak broken
    for step in (20, 25):
        assert state.update(report(step, [0.1, 0.1, 0.5])) is None
    s = state.update(report(30, [0.1, 0.1, 0.5]))
    assert (s["rank"], s["reports"], s["since_step"], round(s["ratio"], 1)) == (2, 3, 20, 5.0)


def test_equal_ranks_are_no_stragglers():
    state = StragglerState()
    assert all(state.update(report(s, [0.2, 0.21])) is None for s in range(10))


def progress(step, **extra):
    return {"epoch": 1, "epochs": 2, "step": step, "total_steps": 20, "loss": 0.5,
            "samples_per_s": 1234.0, "world_size": 2, "checkpoint": None, "time": time.time(),
            "straggler": None, **extra}


def test_plain_lines_when_not_a_terminal(tmp_path):
    store = resolve_storage(str(tmp_path))
    lines = []
    with show_progress(RunFolder(store.fs, str(tmp_path)), lines.append, enabled=True, every_s=0.05):
        write_json(store.fs, f"{tmp_path}/progress.json", progress(5))
        time.sleep(0.3)
        straggler = {"rank": 1, "ratio": 3.0, "reports": 3, "busy_s": 0.3, "median_s": 0.1,
                     "since_step": 5, "node_id": "abcdef0123456789"}
        write_json(store.fs, f"{tmp_path}/progress.json", progress(10, straggler=straggler))
    assert lines[0] == "epoch 1/2  step 5/20  loss 0.5000  1,234 samples/s"
    assert lines[1].startswith("warning: rank 1 is straggling: its own work (data + forward) took 3.0x")
    assert lines[2] == "epoch 1/2  step 10/20  loss 0.5000  1,234 samples/s"


def test_a_bar_on_a_terminal(tmp_path):
    store = resolve_storage(str(tmp_path))
    out = io.StringIO()
    with redirect_stdout(out):
        with show_progress(RunFolder(store.fs, str(tmp_path)), print, enabled=True, terminal=True, every_s=0.05):
            write_json(store.fs, f"{tmp_path}/progress.json", progress(10))
            time.sleep(0.3)
    text = out.getvalue()
    assert "epoch 1/2" in text and "10/20" in text and "loss 0.5000" in text and "\r" in text


def test_quiet_shows_nothing(tmp_path):
    store = resolve_storage(str(tmp_path))
    lines = []
    with show_progress(RunFolder(store.fs, str(tmp_path)), lines.append, enabled=False, every_s=0.05):
        write_json(store.fs, f"{tmp_path}/progress.json", progress(5))
        time.sleep(0.2)
    assert lines == []


def test_the_restart_after_a_hang_is_told_as_the_hangs(tmp_path):
    """Ray Train sees only the processes the hang watch killed (a lost rank, at the last
    step its reports said): the display tells that restart as the hang's, with the hang's
    step and the steps redone from there; a later failure is still a failure."""
    from ray_ddp.record.events import Event

    store = resolve_storage(str(tmp_path))
    hang = Event("hang", 100.0, 10, 1, "10.0.0.7", "hang: no rank finished a step for 11 s after step 10: ...")
    killed = Event("failure", 101.0, 0, 0, "10.0.0.7", "rank 0 was lost (its process 7 died); Ray Train "
                   "restarted the worker group (within --max-failures)", None, 0, True)
    later = Event("failure", 200.0, 17, 1, "10.0.0.7", "rank 1 was lost (its process 9 died); Ray Train "
                  "restarted the worker group (within --max-failures)", "step-00000010", 7, True)
    lines = []
    with show_progress(RunFolder(store.fs, str(tmp_path)), lines.append, enabled=True, every_s=0.05, hangs=lambda: [hang]):
        write_json(store.fs, f"{tmp_path}/progress.json", progress(None, events=[killed.to_dict()]))
        time.sleep(0.3)
        write_json(store.fs, f"{tmp_path}/progress.json",
                   progress(None, events=[killed.to_dict(), later.to_dict()], time=time.time() + 1))
    assert lines == [
        "hang after step 10: Ray Train restarted the worker group the hang watch ended (within "
        "--max-failures); restarted from scratch: 10 steps to redo",
        f"failure after step 17: {later.cause}; restarted from step-00000010: 7 steps to redo"]


def test_progress_json_keeps_its_keys_before_and_after_the_first_report(tmp_path):
    # before a report: only what is known (a worker group's nodes, a restart), as always
    early = Progress(5.0, nodes={"0": "n0"}, events=[{"type": "failure"}])
    assert early.to_dict() == {"time": 5.0, "nodes": {"0": "n0"}, "events": [{"type": "failure"}]}
    # a report: every key docs/run-folder.md gives, a figure the run has none of left out
    report = Progress.from_dict({**progress(5), "preemptions": [], "events": [], "mlflow_failed": False,
                                 "nodes": {}, "report_time": 4.0, "a later key": 1})
    assert set(report.to_dict()) == {"epoch", "epochs", "step", "total_steps", "loss", "samples_per_s", "world_size",
                                     "checkpoint", "time", "straggler", "preemptions", "events", "mlflow_failed", "trackers_failed",
                                     "nodes", "report_time"}
    assert Progress.from_dict(report.to_dict()) == report
    store = resolve_storage(str(tmp_path))
    for text in ("not json", json.dumps({"step": 5}), json.dumps([1])):  # none of them a progress.json
        (tmp_path / "progress.json").write_text(text)
        assert read_progress(RunFolder(store.fs, str(tmp_path))) is None
