"""``ray-ddp train``: flags generated from TrainConfig's fields (one help text per
field), over the keys of ``--config``; runs the driver and prints the ``done:`` line. Runs on the driver."""

from __future__ import annotations

import argparse
import json
import sys

from ray_ddp.cli.common import EXIT_TRAINING_FAILED, config_from_args, fmt
from ray_ddp.config.flags import config_fields
from ray_ddp.errors import TrainingError


def add_parser(sub) -> None:
    train = sub.add_parser("train", help="train a model with DDP on Ray Train workers")
    train.add_argument("--config", metavar="FILE.yaml",
                       help="YAML file of config keys (the flags' names); flags given here win")
    for f in config_fields():
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        if "bool" in kind and f.metadata.get("takes_value"):  # --init-strict false
            train.add_argument(flag, type=parse_bool, default=None, metavar="true|false",
                               help=f.metadata["help"] + f" (default: {str(f.default).lower()})")
            continue
        if "bool" in kind:
            train.add_argument(flag, action="store_true", default=None, help=f.metadata["help"])
            continue
        caster = int if "int" in kind else float if "float" in kind else str
        train.add_argument(flag, type=caster, default=None, choices=f.metadata.get("choices"),
                           metavar=None if f.metadata.get("choices") else f.name.upper(),
                           help=f.metadata["help"] + ("" if f.default is None else f" (default: {f.default})"))


def parse_bool(text: str) -> bool:
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    # here, not at the top: `ray-ddp --help` imports every command's module and needs none of what this one
    # runs; and at the top ``run`` would be this function's own name
    from ray_ddp.driver.run import run

    cfg = config_from_args(args)
    try:
        summary = run(cfg)
    except TrainingError as err:
        print(f"ray-ddp train: {err}", file=sys.stderr)
        return EXIT_TRAINING_FAILED
    if not cfg.quiet and not summary.already_complete:
        print(f"done: {_describe_end(summary, cfg.max_steps)}, final loss "
              f"{fmt(summary.final_loss)}, {fmt(summary.samples_per_s, ',.0f')} samples/s in training "
              f"steps, {fmt(summary.train_samples_per_s, ',.0f')} samples/s from the first step to "
              f"the last, {fmt(summary.wall_samples_per_s, ',.0f')} samples/s over the wall time"
              f"{_describe_validation(summary)}; checkpoint {summary.checkpoint}; metrics {summary.metrics}")
    if summary.profile and not cfg.quiet:
        print(f"profile: steps {cfg.profile} of every rank as Chrome/Perfetto traces in "
              f"{summary.profile}/ (open one in ui.perfetto.dev, or: tensorboard --logdir "
              f"{summary.profile})")
    if cfg.json:
        print(json.dumps(summary.to_dict()))
    return 0


def _describe_end(summary, max_steps) -> str:
    """How far the run went: its epochs, or the step --max-steps ended it at within them."""
    epochs = f"{summary.epochs_completed}/{summary.epochs} epochs"
    if max_steps is not None and summary.steps >= max_steps and summary.epochs_completed < summary.epochs:
        return f"step {summary.steps} (--max-steps; {epochs})"
    return epochs


def _describe_validation(summary) -> str:
    if summary.val_loss is None:
        return ""
    text = f"; validation loss {summary.val_loss:.4f} (best {summary.best_val_loss:.4f})"
    if summary.val_accuracy is not None:
        text += f", accuracy {summary.val_accuracy:.4f}"
    if summary.val_perplexity is not None:
        text += f", perplexity {summary.val_perplexity:.2f}"
    if summary.best_checkpoint:
        text += f"; best checkpoint {summary.best_checkpoint}"
    return text
