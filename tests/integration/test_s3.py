"""A run on s3:// against a real S3 API server on loopback (moto's standalone server,
started here), streaming its rows from the same bucket (--stream), and --early-stop on
it: one story. A run whose validation loss never gets
lower stops after N validations without a lower one, checkpoints that epoch (whatever
--checkpoint-every says), says so on the driver, in summary.json and in metrics.parquet,
and counts as complete on a rerun; a rerun with a larger --early-stop resumes and counts on
from the validations so far (the count survives the resume; the streamed rows go on, every
row once an epoch). The run is then listed,
exported and reported, and every location it prints or records is a URI that opens (the
storage's query kept after the path). (Each Ray Train start costs ~18 CPU-s of a 2-core
machine: the S3 claims, the early stop's and --stream's ride on one Ray Train run, and
the resume, ray_ddp's own, on a run in the gloo harness;
that a streamed epoch's steps and rows do not depend on the world size is
tests/unit/test_stream.py's, and a resume on another world size test_data.py's.)"""

from __future__ import annotations

import dataclasses
import json

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch

from ray_ddp import run
from ray_ddp.cli.main import main
from ray_ddp.data.synth_files import write_synthetic
from ray_ddp.observe.report import write_report
from ray_ddp.observe.runs import list_runs

from ._runs import small
from gloo_run import train_in_gloo

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def s3_storage(tmp_path_factory):
    from s3_server import KEY, SECRET, s3_server

    with s3_server(tmp_path_factory.mktemp("s3")) as (endpoint, bucket):
        yield f"s3://{KEY}:{SECRET}@{bucket}/exp?endpoint_override={endpoint}&scheme=http&region=us-east-1"


def opens(uri: str) -> bool:
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def in_run(run_uri: str, name: str = "") -> tuple[pafs.FileSystem, str]:
    """The filesystem and path of ``name`` in a run folder given as a URI with a query."""
    base, query = run_uri.split("?")
    return pafs.FileSystem.from_uri(f"{base}/{name}?{query}" if name else run_uri)


def read_rows(run_uri: str, name: str = "") -> list[dict]:
    fs, path = in_run(run_uri, name)
    return pq.read_table(path, filesystem=fs).to_pylist()


def test_a_run_on_s3_stops_early_is_complete_resumes_and_is_listed_exported_and_reported(
        ray_local, s3_storage, tmp_path, capsys):
    base, query = s3_storage.split("?")
    # in the bucket: 320 training rows in row groups of 40, streamed (320 / (2 workers x
    # 16) = 10 steps an epoch), and 80 validation rows
    train, val = (f"{base.rsplit('/', 1)[0]}/data/{name}?{query}" for name in ("train", "val"))
    write_synthetic(train, rows=320, features=10, targets=5, seed=3, row_group_rows=40)
    write_synthetic(val, rows=80, features=10, targets=5, seed=4)
    # lr 1e-30: every update is below a float32 weight's last bit, so the weights, and so
    # val_loss, stay exactly as they were: every validation after the first is no lower
    cfg = small(s3_storage, "early-stop", data=train, stream=True, val_data=val, epochs=10, lr=1e-30,
                early_stop=2, checkpoint_every=4, quiet=False)
    lines: list[str] = []
    summary = run(cfg, echo=lines.append)

    assert summary.path == f"{base}/early-stop?{query}"
    assert summary.checkpoint == f"{base}/early-stop/step-00000030?{query}" and opens(summary.checkpoint)
    assert summary.metrics == f"{base}/early-stop/metrics.parquet?{query}" and opens(summary.metrics)
    assert (summary.epochs_completed, summary.steps) == (3, 30)
    assert summary.early_stopped and summary.early_stop_epoch == 3  # forced: --checkpoint-every 4
    fs, folder = in_run(summary.path)
    steps = sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(folder)) if i.base_name.startswith("step-"))
    assert steps == ["step-00000030"]
    said = [line for line in lines if line.startswith("early stop:")]
    assert len(said) == 1, lines
    assert said[0].startswith(f"early stop: val_loss {summary.val_loss:.4f} has not improved for 2 validations "
                              f"(best {summary.val_loss:.4f} at epoch 1); stopped after epoch 3 of 10"), said
    fs, path = in_run(summary.path, "summary.json")
    with fs.open_input_file(path) as f:
        written = json.loads(f.read())
    assert written["early_stopped"] is True and written["early_stop_epoch"] == 3
    evals = read_rows(summary.path, "eval.parquet")
    assert [r["epoch"] for r in evals] == [1, 2, 3] and len({r["loss"] for r in evals}) == 1
    assert {r["samples"] for r in evals} == {80}  # --val-data's 80 rows
    rows = read_rows(summary.metrics)
    assert {r["early_stopped"] for r in rows if r["step"] == 30} == {True}  # every rank's row
    assert {r["early_stopped"] for r in rows if r["step"] in (10, 20)} == {False}
    assert {r["early_stopped"] for r in rows if r["step"] % 10} == {None}  # no validation there

    # the same command again: complete, nothing trained
    lines.clear()
    again = run(cfg, echo=lines.append)
    assert again.already_complete and again.checkpoint == summary.checkpoint and again.early_stopped
    assert any("already complete: --early-stop 2 ended it after epoch 3 of 10" in line for line in lines), lines

    # a larger --early-stop resumes and counts on from epoch 3's count (2): one more
    # validation without a lower val_loss stops it; a count started afresh would go to
    # epoch 7. (On the same world size: on another, the validation mean's rounding differs,
    # and a val_loss lower by a rounding error is an improvement.)
    # (the resume is ray_ddp's own, from the checkpoint the driver found: in the gloo harness)
    more = train_in_gloo(dataclasses.replace(cfg, early_stop=3, quiet=True))
    assert not more.already_complete and more.resumed_from == summary.checkpoint
    assert (more.epochs_completed, more.early_stopped, more.early_stop_epoch) == (4, True, 4)
    rows = read_rows(more.metrics)
    for epoch in (1, 2, 3, 4):  # every streamed row once an epoch, the resumed epoch too
        assert sum(r["samples"] for r in rows if r["epoch"] == epoch) == 320, epoch
    evals = read_rows(more.path, "eval.parquet")
    assert [r["epoch"] for r in evals] == [1, 2, 3, 4]
    assert more.checkpoint == f"{base}/early-stop/step-00000040?{query}" and opens(more.checkpoint)

    [listing] = [r for r in list_runs(s3_storage) if r.name == "early-stop"]
    assert (listing.state, listing.checkpoint, listing.epochs_done) == ("complete", "step-00000040", 4)

    out = tmp_path / "model.pt"
    assert main(["export", "early-stop", "--storage", s3_storage, "--out", str(out)]) == 0
    assert set(torch.load(out, weights_only=True)) == {"net1.weight", "net1.bias", "net2.weight", "net2.bias"}

    report = write_report(s3_storage, "early-stop")
    assert report.files and all(f.startswith(f"{base}/early-stop/report/") and f.endswith(f"?{query}") and opens(f)
                                for f in report.files), report.files
    capsys.readouterr()
