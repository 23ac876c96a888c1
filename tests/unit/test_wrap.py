"""How DDP is wrapped (a real gloo group of one rank, no Ray)."""

import torch

from ray_ddp.parallel.ddp import wrap_ddp
from ray_ddp.models.builtin import build_mlp


def gradients_after_a_step(bucket_view: bool = True, **options):
    torch.manual_seed(0)
    model = build_mlp(8, 2, 16, 2)
    ddp = wrap_ddp(model, [torch.device("cpu")], bucket_view=bucket_view, **options)
    ddp(torch.randn(4, 8)).pow(2).mean().backward()
    return ddp, [p.grad for p in model.parameters()]


def test_gradients_live_in_the_all_reduce_buckets_unless_plain_ddp_is_asked_for(one_rank_group):
    ddp, grads = gradients_after_a_step(bucket_view=True)
    assert ddp.gradient_as_bucket_view
    # every gradient is a view into one of DDP's flat buckets: no copy in or out
    assert all(g._base is not None and g._base.numel() > g.numel() for g in grads)
    plain, plain_grads = gradients_after_a_step(bucket_view=False)
    assert not plain.gradient_as_bucket_view and all(g._base is None for g in plain_grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))  # the same gradients


def test_static_graph_and_bucket_size_reach_ddp_and_change_no_gradient(one_rank_group):
    ddp, grads = gradients_after_a_step()
    assert not ddp.static_graph and ddp.bucket_bytes_cap == 25 * 2**20  # DDP's defaults
    tuned, tuned_grads = gradients_after_a_step(static_graph=True, bucket_mb=0.5)
    assert tuned.static_graph and tuned.bucket_bytes_cap == 2**19
    assert all(torch.equal(a, b) for a, b in zip(grads, tuned_grads))
