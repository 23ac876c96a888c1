"""status.json's identity: the run folder's own id is written once and kept by every
later write (a resume, a failure), and only an id ray_ddp could have made is read back
(tracking searches by it)."""

from __future__ import annotations

import json

from ray_ddp.cluster.placement import plan_placement
from ray_ddp.config.train import TrainConfig
from ray_ddp.driver.status import new_run_id, read_run_id, write_status
from ray_ddp.storage import resolve_storage


def test_the_run_id_is_written_once_and_survives_every_later_status(tmp_path):
    store = resolve_storage(str(tmp_path))
    run_path = store.run_path("r")
    cfg = TrainConfig(name="r", storage=str(tmp_path))
    placement = plan_placement(2, 0, None, {}, local_cpus=4)
    assert read_run_id(store, run_path) is None  # a new folder
    first = new_run_id()
    write_status(store, run_path, "running", cfg, placement, run_id=first)
    write_status(store, run_path, "failed", cfg, placement, error="x")
    write_status(store, run_path, "running", cfg, placement, run_id=new_run_id())  # a resume: the folder's id wins
    assert read_run_id(store, run_path) == first and len(first) == 32
    status = json.loads((tmp_path / "r" / "status.json").read_text())
    status["run_id"] = "x' OR tags.a = 'b"  # a hand-edited file: never put into a search filter
    (tmp_path / "r" / "status.json").write_text(json.dumps(status))
    assert read_run_id(store, run_path) is None
