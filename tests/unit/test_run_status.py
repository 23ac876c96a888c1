"""status.json's identity: the run folder's own id is written once and kept by every
later write (a resume, a failure), and only an id ray_ddp could have made is read back
(tracking searches by it)."""

from __future__ import annotations

import json

from ray_ddp.cluster.placement import plan_placement
from ray_ddp.config.train import TrainConfig
from ray_ddp.record.status import new_run_id, read_run_id, read_status, write_status
from ray_ddp.record.folder import RunFolder, Status
from ray_ddp.storage import resolve_storage
from ray_ddp.driver.resolve import resolve


def test_the_run_id_is_written_once_and_survives_every_later_status(tmp_path):
    store = resolve_storage(str(tmp_path))
    run_path = store.run_path("r")
    cfg = TrainConfig(name="r", storage=str(tmp_path))
    placement = plan_placement(2, 0, None, {}, local_cpus=4)
    assert read_run_id(RunFolder(store.fs, run_path)) is None  # a new folder
    first = new_run_id()
    write_status(RunFolder(store.fs, run_path), "running", resolve(cfg, None), placement, run_id=first)
    write_status(RunFolder(store.fs, run_path), "failed", resolve(cfg, None), placement, error="x")
    write_status(RunFolder(store.fs, run_path), "running", resolve(cfg, None), placement, run_id=new_run_id())  # a resume: the folder's id wins
    assert read_run_id(RunFolder(store.fs, run_path)) == first and len(first) == 32
    status = json.loads((tmp_path / "r" / "status.json").read_text())
    status["run_id"] = "x' OR tags.a = 'b"  # a hand-edited file: never put into a search filter
    (tmp_path / "r" / "status.json").write_text(json.dumps(status))
    assert read_run_id(RunFolder(store.fs, run_path)) is None


def test_status_json_keeps_its_keys_and_a_file_that_is_not_one_reads_as_none(tmp_path):
    store = resolve_storage(str(tmp_path))
    run_path = store.run_path("r")
    cfg = TrainConfig(name="r", storage=str(tmp_path), workers="1-2", epochs=3)
    placement = plan_placement(2, 0, None, {}, local_cpus=4)
    write_status(RunFolder(store.fs, run_path), "running", resolve(cfg, None), placement, run_id=new_run_id())
    written = json.loads((tmp_path / "r" / "status.json").read_text())
    # the keys docs/run-folder.md gives, in the file's order: users' scripts read them
    assert list(written) == ["state", "run_id", "created", "updated", "epochs", "world_size", "workers",
                             "world_sizes", "gpus_per_worker", "model", "error", "events"]
    assert (written["state"], written["epochs"], written["workers"], written["world_size"]) == ("running", 3, "1-2", 2)
    # a newer writer's key is skipped, not an error; the rest reads back
    (tmp_path / "r" / "status.json").write_text(json.dumps({**written, "later": 1}))
    assert read_status(RunFolder(store.fs, run_path)) == Status.from_dict(written)
    for text in ("not json", json.dumps({"epochs": 3}), json.dumps([1])):  # none of them a status
        (tmp_path / "r" / "status.json").write_text(text)
        assert read_status(RunFolder(store.fs, run_path)) is None
    write_status(RunFolder(store.fs, run_path), "failed", resolve(cfg, None), placement, error="x")  # the record starts afresh
    assert read_status(RunFolder(store.fs, run_path)).state == "failed"
