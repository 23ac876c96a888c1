"""Training on real files: parquet written by `ray-ddp data synth`, and a user Dataset."""

from __future__ import annotations

import pytest

from ray_ddp import run
from ray_ddp.datasets import inspect_table, load_table, write_synthetic

from ._runs import rows_of, small

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
def test_training_on_parquet_learns_the_teacher(ray_local, storage, tmp_path, stream):
    write_synthetic(str(tmp_path / "set"), rows=4096, features=10, targets=5, files=3, seed=1,
                    row_group_rows=512)
    _, y = load_table(inspect_table(str(tmp_path / "set"), None, None))
    variance = y.var().item()
    summary = run(small(storage, f"parquet-{stream}", model="mlp", width=64, depth=2,
                        data=str(tmp_path / "set"), stream=stream, batch_size=64, epochs=4,
                        optimizer="adamw", lr=0.01, report_every=8))
    assert summary.steps == 4 * 32  # one pass over 4096 rows at 2 x 64 per step, per epoch
    rows = rows_of(summary)
    epoch_samples = sum(r["samples"] for r in rows if r["epoch"] == 1)
    assert epoch_samples == 4096  # every row once per epoch, across both ranks
    assert summary.final_loss < 0.1 * variance, (summary.final_loss, variance)


def test_a_user_dataset_is_sharded_and_trained(ray_local, storage):
    import user_data

    built = user_data.BUILT
    summary = run(small(storage, "user-dataset", dataset="user_data:regression", batch_size=50,
                        epochs=2, report_every=3))
    assert user_data.BUILT == built + 1  # the driver builds a costly Dataset once, not per check
    assert summary.steps == 2 * 6  # 600 rows / 2 ranks / 50 per step
    assert summary.final_loss < rows_of(summary)[0]["loss"]
