"""Progress output and straggler detection, on real files (no Ray)."""

import io
import time
from contextlib import redirect_stdout

from ray_ddp.observe.stragglers import StragglerState
from ray_ddp.driver.progress import show_progress
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
    with show_progress(store, str(tmp_path), lines.append, enabled=True, every_s=0.05):
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
        with show_progress(store, str(tmp_path), print, enabled=True, terminal=True, every_s=0.05):
            write_json(store.fs, f"{tmp_path}/progress.json", progress(10))
            time.sleep(0.3)
    text = out.getvalue()
    assert "epoch 1/2" in text and "10/20" in text and "loss 0.5000" in text and "\r" in text


def test_quiet_shows_nothing(tmp_path):
    store = resolve_storage(str(tmp_path))
    lines = []
    with show_progress(store, str(tmp_path), lines.append, enabled=False, every_s=0.05):
        write_json(store.fs, f"{tmp_path}/progress.json", progress(5))
        time.sleep(0.2)
    assert lines == []
