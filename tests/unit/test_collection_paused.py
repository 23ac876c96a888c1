"""The worker loop's set-up runs with Python's garbage collector paused
(ray_ddp.worker.loop.collection_paused): off inside, back on after, even after an error; a
collector the user (or a caller) already turned off stays off. And benchmarks/worker_setup.py
refuses --rounds below 1 in one line."""

import gc
import importlib.util
import os

import pytest

from ray_ddp.worker.loop import collection_paused

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                     "benchmarks", "worker_setup.py")


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_set_up_runs_paused_and_training_collects_again(collector_on):
    with collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_an_error_in_set_up_still_turns_collection_back_on(collector_on):
    with pytest.raises(ValueError):
        with collection_paused():
            raise ValueError("a model that does not build")
    assert gc.isenabled()


def test_a_collector_already_off_is_left_off(collector_on):
    gc.disable()
    with collection_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_the_benchmarks_rounds_below_one_is_one_line_and_runs_nothing(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_worker_setup", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--rounds", "0", "--results-dir", str(tmp_path / "results")])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("--rounds 0: give 1 or more")
    assert not (tmp_path / "results").exists()
