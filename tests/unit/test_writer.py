"""Rank 0's checkpoint writer: a copy's memory is reused only after its upload succeeded,
so a retried upload never writes from memory the next checkpoint is refilling."""

import pytest
import torch

from flaky_fs import flaky_fs
from ray_ddp.checkpoint.format import MODEL_FILE, TrainState
from ray_ddp.checkpoint.verify import verify_checkpoint
from ray_ddp.models.builtin import ToyModel
from ray_ddp.checkpoint.writer import CheckpointWriter


def test_a_failed_upload_keeps_its_copy_for_the_retry(tmp_path):
    torch.manual_seed(0)
    model = ToyModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fs = flaky_fs(fail_opens=1, match=MODEL_FILE)  # the first write of model.pt fails
    writer = CheckpointWriter(fs, lambda name: str(tmp_path / name))

    first = writer.snapshot(model, opt, {}, TrainState(1, 10), {}, "unused", False)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(OSError, match="NETWORK_CONNECTION"):
        writer.write(first, "step-00000010")
    assert writer.idle(), "a failed upload does not block the next checkpoint"

    with torch.no_grad():  # training goes on, then the next checkpoint is copied
        model.net1.weight.add_(1.0)
    second = writer.snapshot(model, opt, {}, TrainState(2, 20), {}, "unused", False)
    assert second.model["net1.weight"].data_ptr() != first.model["net1.weight"].data_ptr()

    writer.write(first, "step-00000010")  # Ray's retry of the first upload
    assert verify_checkpoint(str(tmp_path / "step-00000010")) is None
    written = torch.load(tmp_path / "step-00000010" / MODEL_FILE, weights_only=True)
    assert all(torch.equal(written[k], saved[k]) for k in saved), "the first state, untorn"

    writer.write(second, "step-00000020")
    third = writer.snapshot(model, opt, {}, TrainState(3, 30), {}, "unused", False)
    # now the second copy's upload is final, so its memory is reused
    assert third.model["net1.weight"].data_ptr() == second.model["net1.weight"].data_ptr()
