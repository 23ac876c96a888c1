"""Which folders go on the workers' PYTHONPATH for the Python API's objects and
ray_ddp.spawn's functions: the modules their pickles refer to, a notebook's subclass of
the user's own class and a wrapper calling the user's function included; never what the
interpreter has installed (no Ray: the runtime_env is a plain dict)."""

import functools
import os

import torch
from torch import nn

import user_data
import user_models
from ray_ddp.cluster.runtime_env import importable_env, object_modules

HELPERS = os.path.dirname(os.path.abspath(user_models.__file__))


def test_a_subclass_defined_here_brings_its_bases_module():
    class Mine(user_models.FrozenStatsNet):  # as in a notebook: shipped by value, its base by reference
        pass

    assert "user_models" in object_modules(Mine)
    assert "user_models" in object_modules(Mine())
    assert "user_data" in object_modules(type("Rows", (user_data.NumpyRegression,), {})(4))


def test_a_function_defined_here_brings_what_it_calls_and_holds():
    calls = user_models.frozen_stats_net
    demos = (user_data.regression,)

    def wrapper(rank):  # a closure over a function and a tuple of them
        return calls(), [demo() for demo in demos]

    def names_a_module(rank):
        return user_models.FrozenStatsNet()

    assert {"user_models", "user_data"} <= set(object_modules(wrapper))
    assert "user_models" in object_modules(names_a_module)
    assert "user_models" in object_modules(functools.partial(wrapper, 0))
    assert "user_models" in object_modules(user_models.FrozenStatsNet().forward)  # a bound method
    assert object_modules(functools.partial(len, user_models.FrozenStatsNet)) == ["user_models", "torch.nn.modules.module"]


def test_installed_modules_stay_off_the_path_and_the_users_go_on():
    env = importable_env(*object_modules(nn.Linear(2, 2)), *object_modules(torch.randn(2)), "json")
    assert env == {}  # torch and the standard library: the workers' interpreter has them
    path = importable_env(*object_modules(user_models.frozen_stats_net))["env_vars"]["PYTHONPATH"]
    assert path.split(os.pathsep)[0] == HELPERS
