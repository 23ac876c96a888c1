"""--activation-checkpointing without Ray: the gpt's blocks recomputed in backward give
the same loss and gradients and keep less for the backward; a Hugging Face model gets
its own (non-reentrant) checkpointing; any other model is refused in one line."""

from __future__ import annotations

import pytest
import torch

from ray_ddp.config.train import TrainConfig
from ray_ddp.errors import ConfigError
from ray_ddp.models.activation import apply_activation_checkpointing, check_activation_checkpointing
from ray_ddp.models.builtin import GPT, ToyModel, build_mlp


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=64, width=32, depth=3, heads=2, seq_len=16)


def loss_grads_and_saved_bytes(model: GPT, ids: torch.Tensor):
    """One forward and backward; the bytes autograd kept from the forward for the
    backward (tensors saved for backward, each storage once, the weights left out: they
    are held anyway)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved.values())


def test_gpt_with_checkpointing_gives_the_same_loss_and_gradients_and_saves_less():
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    plain, checkpointed = gpt(), gpt()
    keys = list(plain.state_dict())
    apply_activation_checkpointing(checkpointed, TrainConfig(model="gpt", activation_checkpointing=True))
    assert checkpointed.activation_checkpointing and not plain.activation_checkpointing
    assert list(checkpointed.state_dict()) == keys  # old checkpoints still load
    checkpointed.load_state_dict(plain.state_dict())

    loss_a, grads_a, saved_a = loss_grads_and_saved_bytes(plain, ids)
    loss_b, grads_b, saved_b = loss_grads_and_saved_bytes(checkpointed, ids)
    assert loss_a == pytest.approx(loss_b, abs=1e-6)
    for name, grad in grads_a.items():
        assert torch.allclose(grad, grads_b[name], atol=1e-6, rtol=1e-5), name
    # the blocks' attention and MLP activations are recomputed, not kept
    assert saved_b < saved_a / 2, (saved_a, saved_b)


def test_gpt_checkpoints_only_when_a_backward_will_come():
    model = gpt()
    model.set_activation_checkpointing(True)
    ids = torch.randint(0, 64, (2, 8))
    calls = []
    import ray_ddp.models.builtin as builtin

    real = builtin.checkpoint
    builtin.checkpoint = lambda fn, *a, **kw: calls.append(kw) or real(fn, *a, **kw)
    try:
        with torch.no_grad():
            model(ids)  # validation
        model.eval()
        model(ids)
        assert calls == []
        model.train()
        model(ids)
    finally:
        builtin.checkpoint = real
    assert calls == [{"use_reentrant": False}] * 3  # one per block


def test_off_changes_nothing():
    model = ToyModel()
    cfg = TrainConfig(model="toy")
    assert apply_activation_checkpointing(model, cfg) is model
    check_activation_checkpointing(model, cfg)


@pytest.mark.parametrize("name, model", [("toy", ToyModel()), ("mlp", build_mlp(4, 2, 8, 2))])
def test_a_model_without_known_blocks_is_refused_in_one_line(name, model):
    with pytest.raises(ConfigError) as err:
        apply_activation_checkpointing(model, TrainConfig(model=name, activation_checkpointing=True))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"--activation-checkpointing: model {name} (")
    assert "has no blocks ray-ddp knows how to checkpoint" in message


def test_a_hugging_face_model_gets_its_own_non_reentrant_checkpointing():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    flag = "is_activation_checkpointing" if hasattr(model, "is_activation_checkpointing") \
        else "is_gradient_checkpointing"
    assert not getattr(model, flag)
    apply_activation_checkpointing(model, TrainConfig(model="hf:gpt2", activation_checkpointing=True))
    assert getattr(model, flag)
    funcs = [m._gradient_checkpointing_func for m in model.modules()
             if getattr(m, "gradient_checkpointing", False)]
    assert funcs and all(f.keywords.get("use_reentrant") is False for f in funcs)
    # and it trains: a backward through the recomputed layers reaches every weight
    model.train()
    ids = torch.randint(0, 64, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_a_model_with_its_own_switch_is_checkpointed():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.on = False
            self.lin = torch.nn.Linear(2, 2)

        def set_activation_checkpointing(self, enabled):
            self.on = enabled

    net = apply_activation_checkpointing(Net(), TrainConfig(model="python:Net", activation_checkpointing=True))
    assert net.on


def test_fsdp_shards_a_checkpointed_gpt_and_its_gradients_are_the_same(one_rank_group):
    """FSDP2 all-gathers a block again when its recompute runs in backward (its
    pre-backward hook), so sharding composes with the checkpointed blocks."""
    from ray_ddp.parallel.fsdp import shard_model

    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    plain = gpt()
    _, want, _ = loss_grads_and_saved_bytes(plain, ids)
    cfg = TrainConfig(model="gpt", strategy="fsdp", activation_checkpointing=True)
    sharded = shard_model(apply_activation_checkpointing(gpt(), cfg), cfg, torch.device("cpu"))
    sharded.zero_grad()
    logits = sharded(ids[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1)).backward()
    for name, p in sharded.named_parameters():
        assert torch.allclose(p.grad.full_tensor(), want[name], atol=1e-6, rtol=1e-5), name
