"""Accumulation and data parallelism do not change what is learned; the LR schedule
follows warm-up and cosine. (Schedule state across resumes: every resume test in
test_train/test_recovery runs with warm-up, bit-identical to no resume; bf16 on CPU is in
test_train's user-model run.)"""

from __future__ import annotations


import pytest
import torch

from ray_ddp import run
from ray_ddp.checkpoint import MODEL_FILE
from ray_ddp.models import ToyModel

from ._runs import rows_of, small

pytestmark = pytest.mark.ray


def final_weights(summary):
    return torch.load(f"{summary.checkpoint}/{MODEL_FILE}", weights_only=True)


def test_accumulation_and_workers_learn_the_same_weights(ray_local, storage):
    common = dict(epochs=1, steps_per_epoch=6, report_every=1, warmup_steps=4,
                  schedule="cosine", clip_grad=1.0)
    one_big = run(small(storage, "eq-1x256", workers=1, batch_size=256, **common))
    one_accum = run(small(storage, "eq-1x64x4", workers=1, batch_size=64, grad_accum=4, **common))
    two_accum = run(small(storage, "eq-2x64x2", workers=2, batch_size=64, grad_accum=2, **common))
    reference = final_weights(one_big)
    for other in (one_accum, two_accum):
        weights = final_weights(other)
        for key in reference:
            assert torch.allclose(weights[key], reference[key], atol=1e-5), key
    # and not trivially: training moved the weights away from their initial values
    torch.manual_seed(0)
    assert not torch.allclose(ToyModel().state_dict()["net1.weight"], reference["net1.weight"], atol=1e-3)
    assert rows_of(two_accum)[0]["samples"] == 1 * 64 * 2  # per rank: steps x batch x accum
    # the LR after each step, worked out by hand: linear warm-up to 0.05 over 4 steps (the
    # first step runs at 1/4 of it), then cosine from 0.05 at step 4 to 0 at step 6
    want = {1: 0.025, 2: 0.0375, 3: 0.05, 4: 0.05, 5: 0.025, 6: 0.0}
    got = {r["step"]: r["lr"] for r in rows_of(two_accum) if r["rank"] == 0}
    assert got == pytest.approx(want, abs=1e-9)

