"""--lora's spec and its adapters, without Ray: the spec read field by field, the
adapters put on the model with only them left to train, and a model under them told by
the model it adapts (its own loss's reduction, its class in a checkpoint)."""

from __future__ import annotations

import pytest
import torch

from ray_ddp.checkpoint.format import hf_class_name
from ray_ddp.config.lora import AdapterConfig, parse_lora
from ray_ddp.errors import ConfigError
from ray_ddp.models.lora import apply_lora
from ray_ddp.wrappers import is_peft_model, unwrap_peft
from ray_ddp.tasks.build import loss_units_of
from ray_ddp.driver.resolve import resolve


@pytest.mark.parametrize("spec, want", [
    ("r=8,alpha=16,targets=q_proj,v_proj", AdapterConfig(8, 16, 0.0, ("q_proj", "v_proj"))),
    ("targets=c_attn, r=4", AdapterConfig(4, 16, 0.0, ("c_attn",))),
    ("r=2,dropout=0.05", AdapterConfig(2, 16, 0.05, None)),
    ("", AdapterConfig()),
])
def test_a_spec_is_read_field_by_field(spec, want):
    assert parse_lora(spec) == want


@pytest.mark.parametrize("spec, words", [
    ("r=8,r=4", "repeated key 'r'"),
    ("q_proj", "'q_proj' is not key=value"),
    ("alpha=1.5", "whole numbers"),
    ("dropout=1", "dropout in [0, 1)"),
])
def test_a_bad_spec_is_one_line(spec, words):
    with pytest.raises(ConfigError, match=r"^--lora ") as err:
        parse_lora(spec)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_only_the_adapters_train_and_the_model_under_them_tells_what_it_is():
    pytest.importorskip("transformers")
    from hf_tiny import tiny

    model = apply_lora(tiny("gpt2"), "r=2,alpha=4,targets=c_attn", "the tiny GPT-2")
    assert is_peft_model(model) and not is_peft_model(unwrap_peft(model))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert loss_units_of(model) == "shifted"  # a causal LM under them: its labels shift
    assert hf_class_name(model) == "GPT2LMHeadModel"  # what export --format hf rebuilds
    assert torch.equal(unwrap_peft(model).transformer.wte.weight, tiny("gpt2").transformer.wte.weight)


def test_the_model_under_the_adapters_decides_init_weights_units_and_keywords():
    import dataclasses

    from torch import nn

    from ray_ddp.config.train import TrainConfig
    from ray_ddp.models.build import build_model
    from ray_ddp.parallel.units import shard_units
    from ray_ddp.tasks.batches import takes_keyword

    cpu = torch.device("cpu")
    cfg = TrainConfig(model="mlp", input_dim=4, output_dim=2, width=8, depth=2, lora="r=2,targets=0,2")
    bare = dataclasses.replace(cfg, lora=None)
    seen = []
    model = build_model(resolve(cfg, None), [cpu], init=lambda m: seen.append(sorted(m.state_dict())))
    # --init-from's weights meet the model itself (its own keys), then the adapters go on
    assert seen == [sorted(build_model(resolve(bare, None), [cpu]).state_dict())] and is_peft_model(model)
    # FSDP shards the adapted model's layers, not the adapters' wrapper as one unit
    assert len(shard_units(model, cfg)) == len(shard_units(build_model(resolve(bare, None), [cpu]), bare)) > 1

    class NoLabels(nn.Module):  # a forward that takes no labels: the adapters do not change that
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 2)

        def forward(self, input_ids):
            return self.linear(input_ids)

    adapted = apply_lora(NoLabels(), "r=2,targets=linear", "NoLabels")
    assert not takes_keyword(adapted, "labels") and takes_keyword(adapted, "input_ids")


def test_init_from_a_lora_runs_checkpoint_goes_on_from_its_adapters(tmp_path):
    """A --lora run's model.pt holds the adapted model (peft's names): a new run with the
    same --lora starts from its base and adapters; one without --lora is told in one line."""
    import dataclasses

    from ray_ddp.config.train import TrainConfig
    from ray_ddp.models.build import build_model, check_init_from
    from ray_ddp.models.init import apply_init_weights, holds_adapters, read_init_weights

    cpu = torch.device("cpu")
    cfg = TrainConfig(model="mlp", input_dim=4, output_dim=2, width=8, depth=2, lora="r=2,targets=0,2")
    trained = build_model(resolve(cfg, None), [cpu])
    with torch.no_grad():  # what training changed: the adapters (lora_B starts at zero) and nothing else
        for name, p in trained.named_parameters():
            if ".lora_" in name:
                p.add_(torch.randn_like(p))
    torch.save(trained.state_dict(), tmp_path / "model.pt")
    given = str(tmp_path / "model.pt")
    assert holds_adapters(read_init_weights(given, shapes_only=True))

    again = dataclasses.replace(cfg, init_from=given, seed=1)
    check_init_from(resolve(again, None), None, given)  # the driver's check: the adapted model's keys fit
    model = build_model(resolve(again, None), [cpu], init=lambda m: apply_init_weights(m, given, True),
                        init_adapters=True)
    assert model.state_dict().keys() == trained.state_dict().keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.state_dict().items())
    assert {n for n, p in model.named_parameters() if p.requires_grad} == \
        {n for n, p in trained.named_parameters() if p.requires_grad}  # still only the adapters train
    with pytest.raises(ConfigError, match=r"holds LoRA adapters .* pass the --lora it was trained with"):
        check_init_from(resolve(dataclasses.replace(again, lora=None), None), None, given)
    # a model object the Python API passes: the same line without --lora; with it, its workers check
    bare = build_model(resolve(dataclasses.replace(cfg, lora=None), None), [cpu])
    with pytest.raises(ConfigError, match=r"holds LoRA adapters"):
        check_init_from(resolve(dataclasses.replace(again, lora=None), None), bare, given)
    check_init_from(resolve(again, None), bare, given)
    with pytest.raises(ConfigError, match="shapes differ"):  # other adapters: their shapes tell
        check_init_from(resolve(dataclasses.replace(again, lora="r=4,targets=0,2"), None), None, given)
