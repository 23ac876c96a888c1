"""Accumulation and data parallelism do not change what is learned; the LR schedule
follows warm-up and cosine. (Schedule state across resumes: every resume test in
test_train/test_recovery runs with warm-up, bit-identical to no resume; bf16 on CPU is in
test_train's user-model run.)"""

from __future__ import annotations

import math

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
    common = dict(epochs=1, steps_per_epoch=6, report_every=3, warmup_steps=2,
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
    assert rows_of(two_accum)[0]["samples"] == 3 * 64 * 2  # per rank: steps x batch x accum
    for r in rows_of(two_accum):  # warm-up over 2 steps, then cosine to 0 at step 6
        s = r["step"]
        want = 0.05 * ((s + 1) / 2 if s < 2 else 0.5 * (1 + math.cos(math.pi * (s - 2) / 4)))
        assert r["lr"] == pytest.approx(want, abs=1e-12)

