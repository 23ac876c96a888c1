"""Seeing runs: `ray-ddp report` plots, `ray-ddp runs`, straggler warnings, TensorBoard,
Ray's Prometheus series and W&B (all on conftest.py's full_run)."""

from __future__ import annotations

import glob
import json
import struct

import matplotlib.image
import pyarrow.parquet as pq
import pytest

from ray_ddp.cli.main import main
from ray_ddp.observe.report import write_report

pytestmark = pytest.mark.ray


def test_report_draws_pngs_and_names_the_slowest_rank(full_run, storage, tmp_path, capsys):
    assert main(["report", "full", "--storage", str(storage), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "run full: 2 ranks, 30 steps" in out and "slowest rank: " in out
    for name in ("loss.png", "samples_per_s.png", "step_time.png", "busy_time.png"):
        image = matplotlib.image.imread(tmp_path / name)  # a real PNG that decodes
        assert image.shape[0] > 100 and image.shape[1] > 100
        assert f"wrote {tmp_path}/{name}" in out
    assert (tmp_path / "report.txt").read_text().startswith("run full: 2 ranks")


def test_runs_lists_a_complete_run(full_run, storage, capsys):
    assert main(["runs", "--storage", str(storage), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    full = rows["full"]
    assert (full["state"], full["epochs_done"], full["epochs"], full["world_size"]) == ("complete", 3, 3, 2)
    assert full["checkpoint"] == "step-00000030" and full["last_loss"] == pytest.approx(full_run.final_loss)
    assert main(["runs", "--storage", str(storage)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["run", "state", "epochs", "last", "loss", "checkpoint", "world", "restarts",
                                "started"]
    assert full["restarts"] == 0 and any(line.split()[:3] == ["full", "complete", "3/3"] and line.split()[6] == "0"
                                         for line in table)
    assert any(line.split()[:3] == ["full", "complete", "3/3"] for line in table)


def test_report_of_an_unknown_run_is_one_line(storage, capsys):
    assert main(["report", "no-such-run", "--storage", str(storage)]) == 2
    assert capsys.readouterr().err.strip().startswith("ray-ddp report: error: run no-such-run has no metrics.parquet")


def tensorboard_tags(run_dir) -> set[str]:
    """Scalar tags in TensorBoard event files (TFRecord framing, tensorboardX's protos)."""
    from tensorboardX.proto import event_pb2

    tags = set()
    for path in glob.glob(f"{run_dir}/tensorboard/events.out.tfevents.*"):
        data = open(path, "rb").read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            tags |= {v.tag for v in event.summary.value}
            offset += 12 + length + 4
    return tags


def test_straggler_is_warned_about_and_tensorboard_gets_the_metrics(full_story, storage):
    # full_run (conftest.py): rank 1 straggles, 300 ms more a forward; it is warned about
    # and named; TensorBoard gets the metrics; validation shows in the progress line; its
    # file:// URI holds its checkpoint, metrics and summary
    from ray_ddp.checkpoint.verify import find_latest_checkpoint
    from ray_ddp.record.folder import run_folder
    from ray_ddp.storage import resolve_storage

    summary, lines, _ = full_story
    uri = f"file://{storage}"
    assert any("  val_loss " in line for line in lines), lines  # validation in the progress line
    warnings = [l for l in lines if l.startswith("warning: rank 1 is straggling")]
    assert len(warnings) == 1, lines
    report = write_report(uri, "full")
    assert report.slowest_rank == 1 and report.slowest_step_time_s > 1.5 * report.median_step_time_s
    tags = tensorboard_tags(storage / "full")
    assert {"loss/rank_0", "loss/rank_1", "loss/mean", "samples_per_s/total", "busy_s/rank_1",
            "validation/loss"} <= tags

    assert summary.path == f"{uri}/full" and summary.checkpoint == f"{uri}/full/step-00000030"
    assert summary.metrics == f"{uri}/full/metrics.parquet"
    assert len(pq.read_table(storage / "full" / "metrics.parquet")) == 2 * 6  # 2 ranks, a window every 5 of 30 steps
    assert json.loads((storage / "full" / "summary.json").read_text())["run"] == "full"
    store = resolve_storage(uri)  # what a resume would find, through the same filesystem
    assert find_latest_checkpoint(run_folder(store, "full")).latest == "step-00000030"


def test_operators_see_the_run_in_rays_prometheus_and_in_wandb(full_story, storage):
    """full_run's figures, read where operators read them: Ray's Prometheus endpoint over
    127.0.0.1 while it trained (each rank's gauges tagged run, rank and node; rank 1 the
    slower), and W&B's offline files (every window once, its config and its summary)."""
    from wandb_files import read_offline_run

    summary, _, series = full_story
    busy = {}
    for name, labels, value in series:
        if name == "ray_ddp_busy_seconds" and labels.get("run") == "full":
            assert labels["node"], labels
            busy.setdefault(labels["rank"], []).append(value)
    assert set(busy) == {"0", "1"}, sorted({name for name, _, _ in series})
    assert max(busy["1"]) > 1.5 * max(busy["0"])  # the straggler, as Grafana would chart it
    names = {name for name, labels, _ in series if labels.get("run") == "full"}
    assert {"ray_ddp_step_time_seconds", "ray_ddp_samples_per_second", "ray_ddp_loss", "ray_ddp_data_wait_share", "ray_ddp_step",
            "ray_ddp_world_size"} <= names, names
    assert {v for n, l, v in series if n == "ray_ddp_world_size" and l.get("run") == "full"} == {2.0}

    run_id = json.loads((storage / "full" / "status.json").read_text())["run_id"]
    logged = read_offline_run(str(storage / "full"), run_id, timeout_s=30)  # every session finished
    windows = [row for row in logged.history if "loss" in row]
    assert [row["_step"] for row in windows] == [5, 10, 15, 20, 25, 30]
    assert [row["_step"] for row in windows if "val_loss" in row] == [10, 20, 30]
    assert logged.config["model"] == "user_models:slow_on_rank_one" and logged.config["workers"] == 2
    assert logged.summary["final_loss"] == pytest.approx(summary.final_loss)
    assert logged.summary["status"] == "FINISHED" and logged.exit_codes[-1] == 0
