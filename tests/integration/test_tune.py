"""`ray-ddp tune`: 4 trials, 2 at a time, on the shared local Ray; ASHA stops the poor
ones early; trials.parquet and best.json say what happened; every trial is a whole
ray-ddp run in its own folder; the preflight refuses a search the cluster cannot hold."""

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

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def search_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune")
    subprocess.run([sys.executable, "-m", "ray_ddp", "data", "synth", "--rows", "512", "--out",
                    str(root / "rows.parquet"), "--files", "1"], check=True, capture_output=True)
    path = root / "search.yaml"
    path.write_text(yaml.safe_dump({
        "data": str(root / "rows.parquet"), "val_fraction": 0.25, "model": "mlp", "width": 32,
        "workers": 1, "epochs": 4, "batch_size": 32, "report_every": 4, "optimizer": "adamw",
        # a learning rate that learns and one that barely moves: ASHA must tell them apart
        "search": {"lr": {"choice": [0.01, 1e-6]}, "width": {"choice": [16, 32]}},
        "grace_epochs": 1, "trials": 4, "concurrent": 2, "search_seed": 1}))
    return path


@pytest.fixture(scope="module")
def searched(ray_local, storage, search_file):
    lines: list[str] = []
    tc = load_tune_config(str(search_file), {"storage": str(storage), "name": "search"})
    return run_search(tc, echo=lines.append), lines


def test_asha_stops_the_poor_trials_and_best_json_names_the_lowest_val_loss(searched, storage):
    rows, lines = searched
    table = pq.read_table(storage / "search" / "trials.parquet").to_pylist()
    assert sorted(r["trial"] for r in table) == [0, 1, 2, 3]
    assert {"lr", "width", "val_loss", "epochs", "stopped_early", "run"} <= set(table[0])
    assert any(r["stopped_early"] for r in table), table  # ASHA stopped at least one
    assert all(r["epochs"] < 4 for r in table if r["stopped_early"])
    best = json.loads((storage / "search" / "best.json").read_text())
    lowest = min(table, key=lambda r: r["val_loss"])
    assert best["trial"] == lowest["trial"] and best["val_loss"] == lowest["val_loss"]
    assert best["params"] == {"lr": lowest["lr"], "width": lowest["width"]} and best["params"]["lr"] == 0.01
    assert len([line for line in lines if " started: lr=" in line]) == 4
    assert any("stopped early by ASHA" in line for line in lines), lines


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


def test_the_preflight_refuses_more_trials_than_the_cluster_holds(ray_local, storage, search_file):
    tc = load_tune_config(str(search_file), {"storage": str(storage), "name": "too-big", "concurrent": 9})
    with pytest.raises(ConfigError, match=r"9 trials at once x 1 workers x 1 CPU = 9 CPU; the cluster has 8"):
        run_search(tc)
    assert not (storage / "too-big").exists()
