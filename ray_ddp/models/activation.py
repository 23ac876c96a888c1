"""``--activation-checkpointing``: recompute activations in backward instead of keeping
them from the forward (less memory, one more forward of each checkpointed block). A
Hugging Face model checkpoints its own layers (``activation_checkpointing_enable``, or
``gradient_checkpointing_enable`` before transformers 5 renamed it); the built-in gpt,
or any model with a ``set_activation_checkpointing`` method, runs each block through
``torch.utils.checkpoint``. Anything else is refused in one line. Runs on the driver (on
the meta-device model, so a model it cannot apply to is refused before any worker
starts) and on workers.

``models/build.py`` calls ``apply_activation_checkpointing`` on the model it built when
``cfg.activation_checkpointing`` is set, before the strategy wraps or shards it: DDP and
FSDP then see a model whose forward already recomputes.
"""

from __future__ import annotations

from torch import nn

from ray_ddp.config.train import TrainConfig
from ray_ddp.errors import ConfigError


def apply_activation_checkpointing(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """Turn activation checkpointing on in ``model`` (in place) when the config asks for
    it, and return the model; ConfigError for a model ray-ddp cannot checkpoint."""
    if not cfg.activation_checkpointing:
        return model
    check_activation_checkpointing(model, cfg)
    # non-reentrant, said outright: older transformers default to the reentrant form,
    # which recomputes outside the autograd graph that DDP's and FSDP's hooks rely on
    kwargs = {"use_reentrant": False}
    if callable(getattr(model, "activation_checkpointing_enable", None)):
        # transformers 5's name; gradient_checkpointing_enable is its deprecated alias
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif callable(getattr(model, "gradient_checkpointing_enable", None)):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        model.set_activation_checkpointing(True)
    return model


def is_hugging_face(model: nn.Module) -> bool:
    return any(callable(getattr(model, name, None))
               for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"))


def check_activation_checkpointing(model: nn.Module, cfg: TrainConfig) -> None:
    """Refuse, in one line, a model that activation checkpointing cannot be applied to;
    change nothing (the driver checks a model object the Python API passed as it is)."""
    if not cfg.activation_checkpointing:
        return
    name = f"{cfg.model} ({type(model).__name__})"
    if is_hugging_face(model):
        if getattr(model, "supports_gradient_checkpointing", True) is False:
            raise ConfigError(f"--activation-checkpointing: model {name} does not support gradient "
                              "checkpointing (its supports_gradient_checkpointing is False); drop the flag")
        return
    if callable(getattr(model, "set_activation_checkpointing", None)):
        return
    raise ConfigError(
        f"--activation-checkpointing: model {name} has no blocks ray-ddp knows how to checkpoint; "
        "it checkpoints the gpt's blocks, a Hugging Face model (activation_checkpointing_enable) and a "
        "model with a set_activation_checkpointing(enabled) method: add one that runs your blocks "
        "through torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False), or drop the flag")
