"""`ray-ddp tune` on the shared local Ray: 2 trials one at a time, started in the order
the search seed drew them; trials.parquet and best.json say what happened, whatever ASHA
decided; every trial is a whole ray-ddp run in its own folder; the preflight refuses a
search the cluster cannot hold.

Whether ASHA's stop reaches a poor trial before it ends depends on how loaded the machine
is (the stop travels from Tune to the trial's actor to its run), so this test asserts
nothing that timing decides: ASHA's rule, at every order, is tests/unit/test_tune_space.py's;
here, that a trial Tune stopped is recorded as stopped, with fewer epochs and a folder
that can resume, and one that was not ran to the end."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import yaml

from ray_ddp import ConfigError
from ray_ddp.tune.search import run_search
from ray_ddp.tune.space import load_tune_config

from ._runs import run_in_thread, summary_of

pytestmark = pytest.mark.ray


def write_search_file(root):
    subprocess.run([sys.executable, "-m", "ray_ddp", "data", "synth", "--rows", "512", "--out",
                    str(root / "rows.parquet"), "--files", "1"], check=True, capture_output=True)
    path = root / "search.yaml"
    # slow_toy sleeps 0.1 s a step: an epoch of 24 steps takes longer than ASHA's stop
    # takes to reach a trial (the trial reports each validation within POLL_S), so a
    # stopped trial is stopped mid-run, never after it finished by the time the stop came
    path.write_text(yaml.safe_dump({
        "data": str(root / "rows.parquet"), "val_fraction": 0.25, "model": "user_models:slow_toy",
        "workers": 1, "epochs": 4, "batch_size": 16, "report_every": 8, "optimizer": "adamw",
        # a learning rate that learns and one that barely moves: ASHA must tell them apart.
        # search_seed 1 draws 0.01, then 1e-6: the poor trial comes behind a good one (two
        # trials are enough for ASHA to have a rung to stop one at; each is a Ray Train run)
        "search": {"lr": {"choice": [0.01, 1e-6]}},
        "grace_epochs": 1, "trials": 2, "concurrent": 1, "search_seed": 1}))
    return path


def start_search(storage, root, mlflow_uri):
    """The search, tracked in MLflow and W&B (offline), in a thread (conftest.py's ``tune_story`` starts it
    with the first integration test: its trials mostly wait on Tune and Ray Train, and
    the other tests fill those waits). Returns the search file and the started thread."""
    search_file = write_search_file(root)
    lines: list[str] = []
    tracked = search_file.with_name("tracked.yaml")  # the same search, tracked
    tracked.write_text(yaml.safe_dump({**yaml.safe_load(search_file.read_text()), "mlflow": mlflow_uri,
                                       "wandb": "ray-ddp-tests"}))
    tc = load_tune_config(str(tracked), {"storage": str(storage), "name": "search"})
    return search_file, run_in_thread(None, lambda: (run_search(tc, echo=lines.append), lines))


@pytest.fixture(scope="module")
def search_file(tune_story):
    return tune_story[0]


@pytest.fixture(scope="module")
def searched(tune_story):
    return summary_of(*tune_story[1])


def test_trials_parquet_and_best_json_say_what_asha_decided(searched, storage):
    rows, lines = searched
    table = pq.read_table(storage / "search" / "trials.parquet").to_pylist()
    assert sorted(r["trial"] for r in table) == [0, 1]
    assert {"lr", "val_loss", "epochs", "stopped_early", "run"} <= set(table[0])
    by_trial = {r["trial"]: r for r in table}
    assert [by_trial[t]["lr"] for t in (0, 1)] == [0.01, 1e-6]  # the seed's draws
    # the first trial is first at every rung: it runs to the end, whatever the timing
    assert (by_trial[0]["epochs"], by_trial[0]["stopped_early"]) == (4, False)
    for r in table:  # stopped or not, each trial's record says which
        assert (r["epochs"] < 4) == r["stopped_early"] and not r["unfinished"] and r["error"] is None, r
    best = json.loads((storage / "search" / "best.json").read_text())
    lowest = min(table, key=lambda r: r["val_loss"])
    assert best["trial"] == lowest["trial"] and best["val_loss"] == lowest["val_loss"]
    assert best["params"] == {"lr": lowest["lr"]} and best["params"]["lr"] == 0.01
    assert len([line for line in lines if " started: lr=" in line]) == 2
    stopped = [r["trial"] for r in table if r["stopped_early"]]
    assert len([line for line in lines if "stopped early by ASHA" in line]) == len(stopped), lines


def test_every_trial_is_a_whole_ray_ddp_run(searched, storage):
    rows, _ = searched
    best = rows[0]
    folder = storage / "search" / f"trial-{best['trial']}"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["epochs_completed"] == 4 and best["checkpoint"].startswith(str(folder))
    evals = pq.read_table(folder / "eval.parquet").to_pylist()
    assert [r["epoch"] for r in evals] == [1, 2, 3, 4] and evals[-1]["loss"] == pytest.approx(best["val_loss"])
    for r in rows:
        if r["stopped_early"]:  # an interrupted run that its folder can resume
            status = json.loads((storage / "search" / f"trial-{r['trial']}" / "status.json").read_text())
            assert status["state"] == "interrupted"


def test_the_search_is_an_mlflow_run_and_each_trial_one_nested_under_it(searched, storage, mlflow_uri):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name("ray_ddp").experiment_id
    [parent] = client.search_runs([experiment], f"tags.`ray_ddp.location` = '{storage / 'search'}'")
    best = json.loads((storage / "search" / "best.json").read_text())
    assert parent.info.status == "FINISHED" and parent.data.tags["ray_ddp.run"] == "search"
    assert parent.data.metrics["summary.trials"] == 2
    assert parent.data.metrics["summary.best_val_loss"] == pytest.approx(best["val_loss"])
    trials = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(t.data.tags["ray_ddp.run"] for t in trials) == ["trial-0", "trial-1"]
    # each trial's run holds its own windows (a trial ASHA stopped, fewer of them)
    for t in trials:
        steps = [m.step for m in client.get_metric_history(t.info.run_id, "loss")]
        assert steps and len(steps) == len(set(steps)), t.data.tags["ray_ddp.run"]


def test_each_trial_is_a_wandb_run_in_its_searchs_group(searched, storage):
    from wandb_files import read_offline_run

    for trial in ("trial-0", "trial-1"):
        folder = storage / "search" / trial
        logged = read_offline_run(str(folder), json.loads((folder / "status.json").read_text())["run_id"])
        steps = [row["_step"] for row in logged.history if "loss" in row]
        assert "search" in logged.groups and logged.config["name"] == trial
        assert steps and len(steps) == len(set(steps)), trial


def test_the_preflight_refuses_more_trials_than_the_cluster_holds(ray_local, storage, search_file):
    tc = load_tune_config(str(search_file), {"storage": str(storage), "name": "too-big", "concurrent": 15})
    with pytest.raises(ConfigError, match=r"15 trials at once x 1 workers x 1 CPU = 15 CPU; the cluster has 14"):
        run_search(tc)
    assert not (storage / "too-big").exists()


class CreatesFile:
    """Stands for code planted in Tune's pickled state by whoever can write the folder."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_finished_search_rerun_prints_its_table_and_unpickles_nothing(searched, storage, search_file, tmp_path):
    import pickle

    rows, _ = searched
    planted = tmp_path / "pwned"
    for state in ("tuner.pkl", "experiment_state-planted.json"):
        (storage / "search" / "tune" / state).write_bytes(pickle.dumps(CreatesFile(str(planted))))
    lines: list[str] = []
    again = run_search(load_tune_config(str(search_file), {"storage": str(storage), "name": "search"}),
                       echo=lines.append)
    assert not planted.exists(), "Tune's pickled state was loaded"
    assert [r["trial"] for r in again] == [r["trial"] for r in rows]
    assert lines == [f"ray-ddp tune: search search is complete ({storage}/search/trials.parquet)"]
