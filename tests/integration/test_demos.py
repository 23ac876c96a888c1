"""The tutorial's three demos, each a real run through the trainer."""

import pytest

from ray_ddp.demos import run_demo

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("name", ["basic", "checkpoint", "model-parallel"])
def test_demo(ray_local, tmp_path, name):
    result = run_demo(name, workers=2, storage=str(tmp_path), quiet=True)
    assert result.ok and "all 2 ranks hold identical weights" in result.detail
    if name == "checkpoint":
        first, second = result.runs
        assert first.epochs_completed == 1 and second.resumed_from == first.checkpoint
        assert "every rank loaded rank 0's checkpoint step-00000010" in result.detail
