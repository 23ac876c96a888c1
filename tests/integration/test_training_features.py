"""Accumulation and data parallelism do not change what is learned; schedules, bf16 and
clipping survive a resume."""

from __future__ import annotations

import math

import pytest
import torch

from ray_ddp import run
from ray_ddp.checkpoint import MODEL_FILE, STATE_FILE

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
    # and it is not trivially equal: a different global batch learns something else
    half = run(small(storage, "eq-1x128", workers=1, batch_size=128, **common))
    assert not torch.allclose(final_weights(half)["net1.weight"], reference["net1.weight"], atol=1e-5)
    assert rows_of(two_accum)[0]["samples"] == 3 * 64 * 2  # per rank: steps x batch x accum


def expected_lr(step_done: int, lr: float, warmup: int, total: int) -> float:
    s = step_done  # LambdaLR has stepped step_done times
    if s < warmup:
        return lr * (s + 1) / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / (total - warmup))))


def test_schedule_bf16_and_accumulation_survive_a_resume(ray_local, storage):
    kw = dict(steps_per_epoch=10, amp="bf16", grad_accum=2, clip_grad=0.5, warmup_steps=4,
              schedule="cosine", lr=0.1)
    run(small(storage, "sched", epochs=1, **kw))
    state = torch.load(storage / "sched" / "step-00000010" / STATE_FILE, weights_only=True)
    assert state["scheduler"]["last_epoch"] == 10
    summary = run(small(storage, "sched", epochs=2, **kw))
    rows = rows_of(summary)
    for r in rows:  # the cosine ends at the last step of --epochs: 10 steps, then 20 on resume
        total = 10 if r["step"] <= 10 else 20
        assert r["lr"] == pytest.approx(expected_lr(r["step"], 0.1, 4, total), abs=1e-9), r["step"]
    losses = [r["loss"] for r in rows if r["rank"] == 0]
    assert all(math.isfinite(l) for l in losses) and losses[-1] < losses[0]
