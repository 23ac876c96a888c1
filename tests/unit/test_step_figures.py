"""A step's figures without Ray: the input tokens of each batch shape, the gradient norm
before clipping, and the FLOPs of mfu (its formula; the peak is null on CPU)."""

from __future__ import annotations

import torch
from torch import nn

from ray_ddp.tasks.batches import count_tokens
from ray_ddp.worker.flops import PEAK_TFLOPS, flops_per_token, model_flops_utilization, peak_flops
from ray_ddp.worker.step import grad_norm


def test_tokens_are_counted_for_token_batches_only():
    ids = torch.randint(0, 50, (4, 16))
    assert count_tokens(ids) == 64
    assert count_tokens({"input_ids": ids}) == 64
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[:, 10:] = 0  # padding: not tokens the model learns from
    assert count_tokens({"input_ids": ids, "attention_mask": mask}) == 40
    assert count_tokens(torch.randn(4, 10)) == 0 and count_tokens(torch.randint(0, 5, (4,))) == 0


def test_the_norm_is_taken_before_clipping_and_the_gradients_are_clipped():
    model = nn.Linear(3, 1, bias=False)
    model.weight.grad = torch.tensor([[3.0, 4.0, 0.0]])
    assert grad_norm(model.parameters(), 0.0).item() == 5.0  # no clipping: left as it was
    assert torch.equal(model.weight.grad, torch.tensor([[3.0, 4.0, 0.0]]))
    assert grad_norm(model.parameters(), 1.0).item() == 5.0  # reported before clipping...
    assert torch.allclose(model.weight.grad.norm(), torch.tensor(1.0), atol=1e-6)  # ...and clipped


def test_mfu_is_6n_flops_per_token_times_tokens_over_the_peak_and_null_on_cpu():
    model = nn.Linear(100, 10)  # 1010 parameters
    assert flops_per_token(model) == 6 * 1010
    assert peak_flops([torch.device("cpu")]) is None
    assert model_flops_utilization(1000.0, 6 * 1010, None) is None
    assert model_flops_utilization(1e6, 6e9, PEAK_TFLOPS["H100"] * 1e12) == 6e15 / 989e12
