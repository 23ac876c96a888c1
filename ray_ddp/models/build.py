"""How a model name becomes an nn.Module, and the checks of a model before any worker
starts (built on the meta device, so no memory is spent). Runs on the driver and on
workers.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence
import torch
from torch import nn
from ray_ddp.config.callables import load_callable
from ray_ddp.errors import BatchError, ConfigError, TargetShapeError
from ray_ddp.config.train import TrainConfig
from ray_ddp.plan import RunPlan
from ray_ddp.models.activation import apply_activation_checkpointing, check_activation_checkpointing
from ray_ddp.models.hf import build_hf_model, check_hf_folder, is_hf_model
from ray_ddp.models.builtin import GPT, ToyModel, ToyMpModel, build_mlp
from ray_ddp.models.init import adapters_need_lora, check_init_weights, holds_adapters, read_init_weights
from ray_ddp.models.lora import apply_lora
from ray_ddp.tasks.batches import forward, labels_of, logits_of, loss_of, tree_map
from ray_ddp.tasks.build import build_task, class_count_of, loss_units_of, uses_model_loss
from ray_ddp.tasks.own_loss import unknowable_reduction
from ray_ddp.tasks.targets import check_label_range


def build_model(run: RunPlan, devices: Sequence[torch.device], given: Any = None,
                init: Optional[Callable[[nn.Module], Any]] = None, init_adapters: bool = False) -> nn.Module:
    """Build the run's --model on ``devices`` (one device, or a pair for toy-mp), at the
    sizes the plan gives it (``run.input_dim``, ``run.output_dim``); ``given``: a
    model the Python API passed (an nn.Module, or a callable returning one). ``init``
    (--init-from's weights, loaded or checked) meets the model itself, before any
    adapter; weights that hold adapters themselves (``init_adapters``: a --lora run's
    checkpoint) meet the adapted model. With --lora only its adapters train
    (models/lora.py); with --activation-checkpointing its blocks recompute in backward
    (models/activation.py)."""
    cfg = run.config
    if init_adapters and cfg.lora is None:
        raise adapters_need_lora(cfg.init_from)
    model = _build_bare_model(run, devices, given)
    if init is not None and not init_adapters:
        init(model)
    if cfg.lora is not None:
        model = apply_lora(model, cfg.lora, f"model '{cfg.model}'")
        if init is not None and init_adapters:
            init(model)
    return apply_activation_checkpointing(model, cfg)


def _build_bare_model(run: RunPlan, devices: Sequence[torch.device], given: Any = None) -> nn.Module:
    cfg, first, last = run.config, devices[0], devices[-1]
    if given is not None:
        model = given if isinstance(given, nn.Module) else given()
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model= returned {type(model).__name__}, not a torch.nn.Module")
        return model.to(first)
    if is_hf_model(cfg.model):
        return build_hf_model(cfg.model, first)
    if cfg.model == "gpt":
        return GPT(cfg.vocab_size, cfg.width, cfg.depth, cfg.heads, cfg.seq_len).to(first)
    if cfg.model == "toy":
        return ToyModel(run.input_dim, run.output_dim).to(first)
    if cfg.model == "toy-mp":
        return ToyMpModel(first, last, run.input_dim, run.output_dim)
    if cfg.model == "mlp":
        return build_mlp(run.input_dim, run.output_dim, cfg.width, cfg.depth).to(first)
    fn = load_callable(cfg.model)
    try:
        model = fn()
    except Exception as err:
        raise ConfigError(f"model '{cfg.model}' raised {type(err).__name__}: {err}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model '{cfg.model}' returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model.to(first)


def model_stages(name: str) -> int:
    """How many devices the model wants: 2 for the two-stage toy-mp, else 1."""
    return 2 if name == "toy-mp" else 1


def check_model(run: RunPlan, given: Any = None, example: Any = None,
                more_checks: Sequence[Callable[[nn.Module], Any]] = ()) -> int:
    """Build the model on the meta device (a model object the Python API passed is looked
    at as it is) and refuse one DDP cannot train; with ``example`` (a batch of the data's
    first item), also one whose output the task cannot pair with the target.

    Returns the number of trainable parameters. Runs on the driver, before Ray starts.
    """
    cfg, meta = run.config, torch.device("meta")
    if is_hf_model(cfg.model):
        check_hf_folder(cfg.model)
    if isinstance(given, nn.Module):
        model = given
        check_activation_checkpointing(model, cfg)
    else:
        with meta:
            model = build_model(run, [meta, meta], given)
    for check in more_checks:  # what the driver asks besides (the strategy's units)
        check(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trainable == 0:
        raise ConfigError(
            f"model '{cfg.model}' has no parameter that requires grad, so DDP has nothing to "
            "train; unfreeze at least one parameter"
        )
    if example is not None and not isinstance(given, nn.Module):
        check_output_shape(run, model, example)
    elif example is not None:  # an object is not run here (no meta copy of it): what its config says
        labels = labels_of(example[0])
        classes = class_count_of(model)
        if labels is not None and classes is not None and uses_model_loss(model, True, cfg.loss is not None):
            _check_labels(cfg, labels, classes)
    return trainable


def check_init_from(run: RunPlan, given: Any, init_from: str) -> None:
    """``--init-from``'s weights against the model's keys and shapes (on the meta device),
    in one line if they do not fit. Runs on the driver."""
    cfg, meta = run.config, torch.device("meta")
    weights = read_init_weights(init_from, shapes_only=True)

    def check(model: nn.Module) -> None:
        check_init_weights(model, weights, cfg.init_strict, init_from)

    adapters = holds_adapters(weights)
    if isinstance(given, nn.Module):
        if adapters and cfg.lora is None:
            raise adapters_need_lora(init_from)
        if not adapters:  # (a model object under adapters is checked by its workers: no copy of it here)
            check(given)
    else:
        with meta:
            build_model(run, [meta, meta], given, init=check, init_adapters=adapters)


def check_output_shape(run: RunPlan, model: nn.Module, example: Any) -> None:
    """Run the meta-device model on the example batch (the data's first rows, batched as
    the workers batch them) and ask the task whether its output pairs with the target and
    whether the labels are among its outputs, so a mismatch is one line before any worker
    starts. The objective is decided as the worker decides it (uses_model_loss). A model
    that cannot run on the meta device is checked at its first step instead; one that
    fails as it would on any device is one line."""
    cfg = run.config
    ran, out = _run_on_meta(cfg, model, tree_map(_to_meta, example[0]))
    if not ran:
        return
    x, y = example
    if uses_model_loss(model, labels_of(x) is not None, cfg.loss is not None):
        _check_own_loss(cfg, model, out, labels_of(x))
        return
    logits = logits_of(out)
    if cfg.loss is not None or not isinstance(y, torch.Tensor):
        return  # the user's loss pairs them itself
    if not isinstance(logits, torch.Tensor):
        raise ConfigError(f"model '{cfg.model}' returns {type(out).__name__} with no logits and no "
                          "loss; return a tensor, an output with .logits, or a loss")
    task = run.task
    try:
        build_task(task, cfg.seq_len).match_target(logits, _to_meta(y))
    except TargetShapeError as err:
        raise ConfigError(f"model '{cfg.model}': {err}") from None
    if task != "regression":  # class labels, or token ids: indices into the last dimension
        _check_labels(cfg, y, logits.shape[-1])


def _to_meta(t: Any) -> Any:
    return torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t


def _run_on_meta(cfg: TrainConfig, model: nn.Module, inputs: Any) -> tuple[bool, Any]:
    """(True, the output), or (False, None) where the meta device cannot run the model:
    code that needs the values (``.item()``, a numpy round trip, a data-dependent shape)
    or an op without a meta kernel. A TypeError, a missing key or attribute (not about the
    meta device) would stop the first step on any device: one line now."""
    try:
        with torch.no_grad():
            return True, forward(model, inputs)
    except BatchError as err:
        raise ConfigError(f"model '{cfg.model}': {err}") from None
    except (TypeError, KeyError, AttributeError) as err:
        message = " ".join(str(err).split())
        if "meta" in message.lower():
            return False, None
        raise ConfigError(f"model '{cfg.model}' raised {type(err).__name__} on the first training rows: "
                          f"{message}") from None
    except Exception:  # noqa: BLE001 - data-dependent code, a custom op: the worker checks
        return False, None


def _check_own_loss(cfg: TrainConfig, model: nn.Module, out: Any, labels: torch.Tensor) -> None:
    """The model computes its loss from the labels: it must return one, say what it is a
    mean over, and have an output for each class label."""
    if loss_of(out) is None:
        raise ConfigError(f"model '{cfg.model}': the batch hands it labels but its output has "
                          "no loss; return one in .loss, or drop 'labels' from the batch")
    units = loss_units_of(model)
    if units is None and labels.dim() > 1 and not labels.is_floating_point():
        raise ConfigError(unknowable_reduction(f"model '{cfg.model}'"))
    logits = logits_of(out)
    # a head ray_ddp knows whose logits end in one score per class (more than one: a
    # single output is a regression's) takes labels that index them
    if units is not None and isinstance(logits, torch.Tensor) and logits.shape[:-1] == labels.shape \
            and logits.shape[-1] > 1:
        _check_labels(cfg, labels, logits.shape[-1])


def _check_labels(cfg: TrainConfig, labels: torch.Tensor, classes: int) -> None:
    try:
        check_label_range(labels, classes)
    except BatchError as err:
        raise ConfigError(f"model '{cfg.model}': {err}") from None
