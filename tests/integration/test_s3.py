"""A run on s3:// against a real S3 API server on loopback (moto's standalone server,
started here): it trains, resumes, is listed, exported and reported, and every location
it prints or records is a URI that opens (the storage's query kept after the path)."""

from __future__ import annotations

import pyarrow.fs as pafs
import pytest
import torch

from ray_ddp import run
from ray_ddp.cli.main import main
from ray_ddp.observe.report import write_report
from ray_ddp.observe.runs import list_runs

from ._runs import small

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def s3_storage(tmp_path_factory):
    from s3_server import KEY, SECRET, s3_server

    with s3_server(tmp_path_factory.mktemp("s3")) as (endpoint, bucket):
        yield f"s3://{KEY}:{SECRET}@{bucket}/exp?endpoint_override={endpoint}&scheme=http&region=us-east-1"


def opens(uri: str) -> bool:
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def test_a_run_on_s3_trains_resumes_lists_exports_and_reports(ray_local, s3_storage, tmp_path, capsys):
    base, query = s3_storage.split("?")
    first = run(small(s3_storage, "s3run", epochs=1))
    assert first.checkpoint == f"{base}/s3run/step-00000010?{query}" and opens(first.checkpoint)
    assert first.path == f"{base}/s3run?{query}" and first.metrics == f"{base}/s3run/metrics.parquet?{query}"
    assert opens(first.metrics)
    second = run(small(s3_storage, "s3run", epochs=2))  # the same command, one more epoch: resumes
    assert second.resumed_from == first.checkpoint and second.epochs_completed == 2 and second.steps == 20
    [listing] = [r for r in list_runs(s3_storage) if r.name == "s3run"]
    assert (listing.state, listing.checkpoint, listing.epochs_done) == ("complete", "step-00000020", 2)

    out = tmp_path / "model.pt"
    assert main(["export", "s3run", "--storage", s3_storage, "--out", str(out)]) == 0
    assert set(torch.load(out, weights_only=True)) == {"net1.weight", "net1.bias", "net2.weight", "net2.bias"}

    report = write_report(s3_storage, "s3run")
    assert report.files and all(f.startswith(f"{base}/s3run/report/") and f.endswith(f"?{query}") and opens(f)
                                for f in report.files), report.files
    capsys.readouterr()
