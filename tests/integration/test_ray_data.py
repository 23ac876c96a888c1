"""Ray Data as a run's input: a classifier trained from ``ray.data.read_parquet`` with a
preprocessing step, validated on another Ray Dataset, each row of an epoch once; and
``--data PATH --ray-data`` from the command line's config."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_ddp import TrainConfig, run

from ._runs import rows_of

pytestmark = pytest.mark.ray


def write_classes(path, rows, seed, offset=0.0):
    """Four features whose signs decide one of 3 classes, in 4 files; ``offset``: the
    features shifted and scaled, as raw data a preprocessing step must undo."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 4)).astype("float32")
    label = ((x[:, 0] > 0).astype(int) + (x[:, 1] > 0).astype(int)).astype("int64")
    x = x * (1 + offset) + offset
    path.mkdir()
    for k, part in enumerate(np.array_split(np.arange(rows), 4)):
        pq.write_table(pa.table({**{f"f{i}": x[part, i] for i in range(4)}, "t0": label[part]}),
                       path / f"part-{k}.parquet")
    return path


def standardize(batch):
    for i in range(4):
        batch[f"f{i}"] = (batch[f"f{i}"] - 9.0) / 10.0
    return batch


@pytest.fixture(scope="module")
def ray_data_run(ray_local, storage, tmp_path_factory):
    """Training rows read by --data PATH --ray-data (ray.data.read_parquet), validation
    a Ray Dataset of the Python API with a preprocessing step (map_batches)."""
    import ray.data

    root = tmp_path_factory.mktemp("raydata")
    # the user's own read: Ray Data's default would start 32 footer-reading actors for it
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", "1")
        val = ray.data.read_parquet(str(write_classes(root / "val", 301, 1, offset=9.0))).map_batches(standardize)
    cfg = TrainConfig(workers=2, epochs=2, batch_size=25, model="mlp", width=32, lr=0.2, report_every=5,
                      data=str(write_classes(root / "train", 1000, 0)), ray_data=True,
                      storage=str(storage), name="ray-data", quiet=True)
    readers = footer_readers()
    summary = run(cfg, val_data=val)
    return summary, footer_readers() - readers


def footer_readers() -> int:
    """FooterReader actors this Ray has made so far (Ray's own state table: a test's view)."""
    from ray._private import state

    return sum(1 for actor in state.actors().values() if actor["ActorClassName"] == "FooterReader")


def test_a_classifier_trains_from_ray_data_and_validates_on_another(ray_data_run):
    s, footer_readers_started = ray_data_run
    assert s.task == "classification" and s.steps == 2 * 20  # 1,000 rows in global batches of 50
    # learnable, and the validation rows were standardized (Ray Data hands out blocks as
    # the workers ask, so the order of the rows, and the figure, vary from run to run)
    assert s.val_accuracy > 0.8, s
    rows = rows_of(s)
    # every epoch: 500 rows per rank (streaming_split(equal=True) of 1,000 rows over 2)
    for epoch in (1, 2):
        assert sum(r["samples"] for r in rows if r["epoch"] == epoch) == 1000
    # validation counts each of the 301 rows once, over both ranks, every epoch
    evals = pq.read_table(s.metrics.replace("metrics.parquet", "eval.parquet")).to_pylist()
    assert [r["samples"] for r in evals] == [301, 301]
    # ray-ddp's read of the 4 files asked Ray Data for one footer reader, not its 32: Ray
    # Data lists the set when it plans the read and again for each epoch, one reader each
    assert 1 <= footer_readers_started <= 3, footer_readers_started


def test_a_ray_whose_cpus_the_workers_take_all_of_is_one_line_before_any_worker_starts(ray_local, tmp_path):
    """Ray Train keeps the workers' CPUs from Ray Data, whose read and map tasks then get
    none: the run would wait without a word. On a Ray sized exactly to the workers (the
    suite's shared Ray: every CPU slot a worker), one line instead, and nothing written."""
    import ray
    import ray.data

    from ray_ddp import ConfigError

    cpus = int(ray.cluster_resources()["CPU"])
    train = ray.data.from_arrow(pq.read_table(write_classes(tmp_path / "train", 100, 0)))
    cfg = TrainConfig(workers=cpus, epochs=1, batch_size=cpus, model="mlp", storage=str(tmp_path / "runs"),
                      name="no-cpu-for-ray-data", quiet=True)
    with pytest.raises(ConfigError) as err:
        run(cfg, train_data=train)
    assert str(err.value) == (f"Ray Data reads and transforms the data in tasks beside the workers, but the {cpus} "
                              f"workers x 1 CPU take all {cpus} CPU of the cluster: lower --workers or "
                              "--cpus-per-worker, or add a node")
    assert not (tmp_path / "runs" / "no-cpu-for-ray-data").exists()
