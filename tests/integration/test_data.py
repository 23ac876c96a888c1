"""Training on real files: a folder of parquet files held in memory, and a user Dataset,
over a resize; DataLoader processes reading the Dataset (after a resize). (Rows streamed
with --stream: test_s3.py's run, from its bucket; a stream's cut at any world size:
tests/unit/test_stream.py.)"""

from __future__ import annotations

import shutil

import pytest

from ray_ddp import run

from ._runs import rows_of, small
from gloo_run import train_in_gloo

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def same_rows_as_parquet(tmp_path_factory):
    """user_data:regression's 600 rows as a folder of 3 parquet files (row groups of 50),
    so the in-memory and Dataset paths train on the very same rows: a parquet set whose
    steps, epochs and weights match the Dataset's is read whole, in order, each row with
    its own target."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import user_data

    x, y = user_data.regression()[:]
    columns = {f"f{i}": pa.array(x[:, i].numpy()) for i in range(10)}
    columns.update({f"t{i}": pa.array(y[:, i].numpy()) for i in range(5)})
    table, path = pa.table(columns), tmp_path_factory.mktemp("resize") / "rows"
    path.mkdir()
    for k in range(3):
        pq.write_table(table.slice(200 * k, 200), path / f"part-{k}.parquet", row_group_size=50)
    return str(path)


def model_weights(summary):
    import torch

    return torch.load(f"{summary.checkpoint}/model.pt", weights_only=True)


@pytest.fixture(scope="module")
def unresized(storage):
    """A user's Dataset, 3 epochs at 2 workers x 50 rows: the run the resized ones must
    match (the Dataset and the in-memory table are sharded alike). In plain gloo
    processes: the Dataset's sharding is ray_ddp's (on Ray: the chain's last leg)."""
    import user_data

    built = user_data.BUILT
    summary = train_in_gloo(small(storage, "user-dataset", dataset="user_data:regression", batch_size=50,
                                  warmup_steps=0, keep=3))
    assert user_data.BUILT == built + 1  # the driver builds a costly Dataset once, not per check
    return summary


def test_a_user_dataset_is_sharded_and_trained(unresized):
    assert unresized.steps == 3 * 6  # 600 rows / (2 ranks x 50) per step
    assert unresized.final_loss < rows_of(unresized)[0]["loss"]
    assert sum(r["samples"] for r in rows_of(unresized) if r["epoch"] == 1) == 600  # no padding


# A user's Dataset and in-memory rows go through the same IndexedSource (only the fetch
# differs, and the Dataset's is tested above): resizing is tested on the in-memory rows,
# the chain going back to 2 workers on the Dataset read by DataLoader processes.
@pytest.fixture(scope="module")
def resized(ray_local, storage, same_rows_as_parquet, unresized):
    """The reference run's epoch 1 at 2 workers, then epoch 2 on the in-memory rows on 1
    worker (2 -> 1) and epoch 3 on 2 again (1 -> 2), reading the reference's Dataset with
    2 DataLoader processes per rank (--loader-workers 2), the global batch 100 throughout.
    Epochs 1 and 2 are ray_ddp's own arithmetic (the sharding, a resume's cut at another
    world size): they run in plain gloo processes (tests/helpers/gloo_run.py); epoch 3,
    the module path's Dataset read by DataLoader processes inside Ray workers, on Ray."""
    name = "resized-in-memory"
    # epoch 1 at 2 workers: the reference run as it stood then (its folder, later checkpoints gone)
    shutil.copytree(storage / "user-dataset", storage / name)
    for step in ("step-00000012", "step-00000018"):
        shutil.rmtree(storage / name / step)
    for epochs, workers, data, train in ((2, 1, dict(data=same_rows_as_parquet), train_in_gloo),
                                         (3, 2, dict(dataset="user_data:regression", loader_workers=2), run)):
        summary = train(small(storage, name, workers=workers, batch_size=100 // workers, epochs=epochs,
                              warmup_steps=0, **data))
    return summary


def test_loader_workers_read_exactly_the_rows_of_the_training_thread(resized, unresized):
    """--loader-workers 2 (the in-memory chain's epoch 3): the same rows in the same steps
    as the reference's training thread read, so its losses, window by window, and its
    weights, to float tolerance (epoch 2's sums were taken on 1 worker)."""
    import torch

    loaded = [r for r in rows_of(resized) if r["epoch"] == 3]
    reference = [r for r in rows_of(unresized) if r["epoch"] == 3]
    assert [(r["step"], r["rank"]) for r in loaded] == [(r["step"], r["rank"]) for r in reference]
    assert [r["loss"] for r in loaded] == pytest.approx([r["loss"] for r in reference], rel=1e-4)
    weights, want = model_weights(resized), model_weights(unresized)
    assert all(torch.allclose(weights[k], want[k], atol=1e-5) for k in want)


def test_resume_on_another_world_size_keeps_every_epoch_whole(resized, unresized):
    import torch

    summary = resized
    assert summary.epochs_completed == 3 and summary.steps == 18  # 6 steps of 100 rows per epoch
    rows = rows_of(summary)
    for epoch, world in ((1, 2), (2, 1), (3, 2)):
        in_epoch = [r for r in rows if r["epoch"] == epoch]
        assert {r["world_size"] for r in in_epoch} == {world}
        assert sum(r["samples"] for r in in_epoch) == 600, "every row once per epoch"
    assert summary.final_loss < 0.8 * rows[0]["loss"]  # it learns the teacher's targets (1.11 -> 0.67)
    # a step holds the same 100 rows at any world size: the same weights, to float tolerance
    weights, reference = model_weights(summary), model_weights(unresized)
    for key in reference:
        assert torch.allclose(weights[key], reference[key], atol=1e-5), key
