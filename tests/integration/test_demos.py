"""The tutorial's demos, each a real run of ray_ddp's worker loop; each claim a demo prints
is checked here again from the files its runs left. They train in the gloo harness
(tests/helpers/gloo_run.py): what a demo shows (identical weights, every rank loading
rank 0's checkpoint, two stages per worker) is ray_ddp's loop and checkpoints, not Ray's.
Ray's side of the same paths: full_run (the toy), the S3 run and the interrupted driver
(a second command resuming from the checkpoint the first left)."""

import pytest
import torch

from ray_ddp.checkpoint.format import MODEL_FILE
from ray_ddp.checkpoint.verify import weights_hash
from ray_ddp.driver.demos import run_demo
from ray_ddp.models.builtin import ToyModel, ToyMpModel

from gloo_run import train_in_gloo

from ._runs import final_hashes, rows_of

pytestmark = pytest.mark.ray


def saved_hash(checkpoint, model):
    model.load_state_dict(torch.load(f"{checkpoint}/{MODEL_FILE}", weights_only=True))
    return weights_hash(model)


# "basic" is one run of the toy model, exactly the checkpoint demo's second run without the
# resume, so it is not run again here.
@pytest.mark.parametrize("name", ["checkpoint", "model-parallel"])
def test_demo(tmp_path, name):
    result = run_demo(name, workers=2, storage=str(tmp_path), quiet=True, train=train_in_gloo)
    last = result.runs[-1]
    hashes = final_hashes(rows_of(last))
    # every rank ended with the same weights, and they are the weights rank 0 saved
    assert sorted(hashes) == [0, 1] and len(set(hashes.values())) == 1
    model = ToyMpModel("cpu", "cpu") if name == "model-parallel" else ToyModel()
    assert saved_hash(last.checkpoint, model) == hashes[0]
    assert "all 2 ranks hold identical weights" in result.detail
    if name == "checkpoint":
        first, second = result.runs
        assert first.epochs_completed == 1 and second.resumed_from == first.checkpoint
        # every rank of the second run loaded what the first run's rank 0 saved
        loaded = {r["rank"]: r["loaded_hash"] for r in rows_of(second) if r["loaded_hash"] is not None}
        assert loaded == {0: saved_hash(first.checkpoint, ToyModel()), 1: saved_hash(first.checkpoint, ToyModel())}
        assert "every rank loaded rank 0's checkpoint step-00000010" in result.detail
