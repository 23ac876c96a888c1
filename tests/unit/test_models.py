"""Models: the tutorial's networks, mlp, user callables, and the refusal of frozen models."""

import pytest
import torch

from ray_ddp.errors import ConfigError
from ray_ddp.config.train import TrainConfig
from ray_ddp.models.builtin import ToyModel, ToyMpModel
from ray_ddp.driver.resolve import resolve
from ray_ddp.models.build import build_model, check_model, model_stages

CPU = torch.device("cpu")


def checked(**options) -> TrainConfig:
    """The user's checked options (resolve() makes the plan models are built from: its
    sizes synthetic data's)."""
    return TrainConfig(**options).validate()


def test_toy_is_the_tutorial_network():
    model = build_model(resolve(checked(), None), [CPU])
    assert isinstance(model, ToyModel)
    assert [tuple(p.shape) for p in model.parameters()] == [(10, 10), (10,), (5, 10), (5,)]
    assert model(torch.randn(20, 10)).shape == (20, 5)


def test_toy_mp_has_toy_parameter_names_and_runs_on_one_device():
    mp = build_model(resolve(checked(model="toy-mp"), None), [CPU, CPU])
    assert isinstance(mp, ToyMpModel)
    assert list(mp.state_dict()) == list(ToyModel().state_dict())
    mp.load_state_dict(ToyModel().state_dict())  # checkpoints are interchangeable
    assert mp(torch.randn(4, 10)).shape == (4, 5)
    assert model_stages("toy-mp") == 2 and model_stages("toy") == 1


def test_mlp_width_and_depth():
    mlp = build_model(resolve(TrainConfig(model="mlp", width=32, depth=3, input_dim=8, output_dim=2), None), [CPU])
    linears = [m for m in mlp if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(8, 32), (32, 32), (32, 32), (32, 2)]


def test_user_callable_model():
    model = build_model(resolve(TrainConfig(model="user_models:small_net"), None), [CPU])
    assert model(torch.randn(2, 10)).shape == (2, 5)
    assert check_model(resolve(TrainConfig(model="user_models:small_net"), None)) == 10 * 16 + 16 + 16 * 5 + 5


@pytest.mark.parametrize("spec, fragment", [
    ("user_models:frozen_net", "has no parameter that requires grad"),
    ("user_models:not_a_module", "returned Tensor, not a torch.nn.Module"),
    ("user_models:nothing_here", "has no callable named nothing_here"),
    ("user_models:raises", "raised RuntimeError: weights file missing"),
    ("broken_import:build", "cannot import broken_import (ModuleNotFoundError"),
    ("no_such_module:build", "cannot import no_such_module"),
])
def test_bad_user_models_are_refused(spec, fragment):
    with pytest.raises(ConfigError) as err:
        check_model(resolve(TrainConfig(model=spec), None))
    assert fragment in str(err.value)


def test_check_model_builds_on_meta_without_memory():
    # A 4096-wide, 8-deep mlp would take ~0.5 GB of real memory; on meta it costs nothing.
    assert check_model(resolve(checked(model="mlp", width=4096, depth=8), None)) > 100_000_000
